"""Re-package Catalyst 22.4's wheel with metadata today's pip accepts: ``vendor/catalyst-22.4+nbddp.1-…whl``.

Catalyst 22.4 (Apache-2.0, its last release: the project is no longer maintained) declares
``scikit-image (<0.19.0>=0.16.1)`` for its ``cv`` and ``all`` extras, a version specifier that is not valid
(PEP 440). pip 24.1 and newer reject a candidate whose metadata doesn't parse, so ``pip install catalyst==22.4``
finds nothing, whatever extras are asked for, and ``--no-deps`` doesn't help (pip reads the metadata to
choose). This copies the wheel as it is but for that specifier, corrected to ``<0.19.0,>=0.16.1``, and its
version, ``22.4+nbddp.1`` (a local version: ``catalyst==22.4`` still matches it), then rewrites ``RECORD``.
The code is Catalyst's own, byte for byte.

``pip download catalyst==22.4 --no-deps`` (pip below 24.1, or ``uv pip download``) fetches the original;
``python vendor/repackage_catalyst.py catalyst-22.4-py2.py3-none-any.whl vendor/`` writes the new one.
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

OLD, NEW = "22.4", "22.4+nbddp.1"
BROKEN, FIXED = b"scikit-image (<0.19.0>=0.16.1)", b"scikit-image (<0.19.0,>=0.16.1)"
#: A fixed time for every entry, so that the same input gives the same file.
WHEN = (2022, 4, 1, 0, 0, 0)


def repackage(original: Path, folder: Path) -> Path:
    old_info, new_info = f"catalyst-{OLD}.dist-info/", f"catalyst-{NEW}.dist-info/"
    target = folder / original.name.replace(f"catalyst-{OLD}-", f"catalyst-{NEW}-")
    records = []
    with zipfile.ZipFile(original) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as wheel:
        for item in source.infolist():
            name = item.filename.replace(old_info, new_info)
            if name == f"{new_info}RECORD":
                continue
            data = source.read(item)
            if name == f"{new_info}METADATA":
                assert BROKEN in data, "not Catalyst 22.4's metadata"
                data = data.replace(BROKEN, FIXED).replace(f"\nVersion: {OLD}\n".encode(), f"\nVersion: {NEW}\n".encode())
            entry = zipfile.ZipInfo(name, WHEN)
            entry.external_attr = item.external_attr
            wheel.writestr(entry, data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{name},sha256={digest},{len(data)}")
        records.append(f"{new_info}RECORD,,")
        entry = zipfile.ZipInfo(f"{new_info}RECORD", WHEN)
        wheel.writestr(entry, "\n".join(records) + "\n", zipfile.ZIP_DEFLATED)
    return target


if __name__ == "__main__":
    print(repackage(Path(sys.argv[1]), Path(sys.argv[2])))
