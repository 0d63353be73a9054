"""The training cell and its setup of a notebook with no cell marked, chosen as a careful reader would.

A notebook written for Accelerate, Lightning, the Hugging Face Trainer, Catalyst or PyTorch's DDP tutorial says
where its training starts: the cell that calls ``notebook_launcher(...)``, ``trainer.fit(...)``, ``trainer.train()``,
a Catalyst runner's ``.train(..., ddp=True)`` or ``mp.spawn(...)`` (what each engine's record recognises:
:func:`nbddp.engines.read_launches`). With no cell marked (a papermill ``parameters`` cell aside), that cell is the
training cell (two such cells are refused, naming each; ``--train-cell N`` names one where the launch is a library's
own), and the earlier cells it depends on are its setup, found from the names
each cell reads and binds (:func:`nbddp.contracts.freevars.cell_names`), transitively:

- a name a chosen cell reads comes from the last cell before it that binds it, and from earlier ones
  too where that one binds it only under an ``if``/``for``/``try`` (either may be the value);
- a cell in between that changes that object in place (``model.apply(init)``, ``cfg["lr"] = 0.1``) is
  chosen too, as is every cell before the training that seeds a random generator;
- the parameters cells are always setup (as in a marked notebook).

Every other cell (plots, exploration) runs only in the kernel. Where a choice can't be made safely
(a needed cell reads ``display`` or ``get_ipython``, which only a kernel has; a needed name comes only
from a cell nbddp can't read), nbddp refuses, naming the cell and what to mark. What was chosen is said
in one line (:attr:`nbddp.notebook.cells.Selection.note`): at a run's start, and in the script's header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Sequence

from nbddp.engines import launch_texts, read_launches
from nbddp.contracts.errors import CellError, CellSyntaxError, NotebookError, see
from nbddp.notebook.roles import INJECTED, PARAMETERS, TRAIN, ExportedCell, Exports, Selection
from nbddp.contracts.freevars import KERNEL_ONLY, CellNames, cell_names
from nbddp.notebook.reader import Cell, Notebook


def launching_cell(notebook: Notebook) -> tuple[Cell, str] | None:
    """The first unmarked code cell that launches a library's training, and the call (``trainer.fit``)."""
    found = _launchings(notebook, _read(Exports(notebook), notebook)).found
    return found[0] if found else None


def choose(notebook: Notebook, exports: Exports, returns: Sequence[str] = (), train_cell: int | None = None
           ) -> Selection:
    """The cells of an unmarked notebook's script: its launching cell (or cell ``train_cell``: ``--train-cell``, for
    a library that launches its training in a call nbddp can't recognise, such as a wrapper of Catalyst's) as
    training, what it needs as setup.

    ``exports``: its cells, exported on demand. ``returns``: the variables the run hands back (``--return``),
    which the script must define too.

    Raises:
        NotebookError: nothing launches a library's training (what to mark), several cells do (which, and how to
            name the one meant), ``train_cell`` is no code cell, or the setup can't be chosen safely (which cell,
            and what to mark).
        CellError: the training cell can't be exported; with nothing found to train, the first cell that isn't
            valid Python (the kernel stops there too).
    """
    read = _read(exports, notebook)
    names = {number: _names(exported) for number, exported in read.items()}  # every cell's, read once
    training, launch = _training_cell(notebook, read, train_cell)
    trained = replace(read[training.number], role=TRAIN)  # (exported as any cell is: its role aside, the same)
    trained_names = names[training.number]
    before = [cell for cell in notebook.code_cells if cell.number < training.number]
    chosen = _Closure(notebook, before, read, names, training, launch)
    for cell in before:
        if cell.role in (PARAMETERS, INJECTED):
            chosen.include(cell, "it is a parameters cell")
    chosen.need(training.number, [*trained_names.needs, *(r for r in returns if r not in trained_names.defines)])
    for cell in before:  # a seed changes what every later cell draws, the training's setup included
        if (read_names := chosen.names[cell.number]) is not None and read_names.seeds:
            chosen.include(cell, "it seeds a random generator")
    chosen.settle()
    setup = [c for c in before if c.number in chosen.numbers]
    for cell in setup:
        if isinstance(error := read[cell.number], CellError):
            raise error  # a parameters cell, exported whatever the training needs (the others chosen were read)
    if chosen.problems:
        raise NotebookError(chosen.refusal(chosen.problems[0]))
    cells = [read[c.number] for c in setup]
    kernel_only = [c.number for c in notebook.code_cells if c.number not in chosen.numbers and c is not training]
    return Selection((*cells, trained), _note(training.number, launch, [c.number for c in setup], kernel_only))


def _read(exports: Exports, notebook: Notebook) -> dict[int, ExportedCell | CellError]:
    """Every code cell exported as setup (its own role for a parameters cell), or why it can't be."""
    return {cell.number: exports[cell] for cell in notebook.code_cells}


def _training_cell(notebook: Notebook, read: dict[int, ExportedCell | CellError],
                   train_cell: int | None) -> tuple[Cell, str]:
    """The training cell and how it was found: ``train_cell``, else the one cell that launches a training."""
    if train_cell is not None:
        cell = next((c for c in notebook.code_cells if c.number == train_cell), None)
        code_cells = f"the code cells: {_numbers([c.number for c in notebook.code_cells]) or 'none'}"
        if train_cell > len(notebook.cells):
            raise NotebookError(f"{notebook.path}: --train-cell {train_cell}: the notebook has {len(notebook.cells)} "
                                f"cells ({code_cells}).")
        if cell is None:
            raise NotebookError(f"{notebook.path}: --train-cell {train_cell}: cell {train_cell} is not a code cell "
                                f"({code_cells}).")
        if cell.role is not None:
            raise NotebookError(f"{notebook.path}: --train-cell {train_cell}: cell {train_cell} is the notebook's "
                                f"{cell.role} cell, which sets the run's values: name the cell that trains.")
        if isinstance(error := read[cell.number], CellError):
            raise error
        return cell, f"--train-cell {train_cell}"
    launches = _launchings(notebook, read)
    found = launches.found
    if len(found) > 1:
        each = ", ".join(f"cell {cell.number} ({call})" for cell, call in found)
        raise NotebookError(
            f"{notebook.path}: no cell is marked, and {len(found)} cells launch a training: {each}; nbddp can't tell "
            f"which is meant. Name it with --train-cell N (nbddp still chooses its setup), or start it with "
            f"'#| ddp-train' and the cells it needs with '#| ddp'." + see("no-training-cell"))
    if not found:
        invalid = next((e for e in read.values() if isinstance(e, CellSyntaxError)), None)
        if invalid is not None:
            raise invalid
        raise NotebookError(no_training_cell(notebook, hints=launches.hints))
    return found[0]


@dataclass(frozen=True)
class _Launches:
    found: list[tuple[Cell, str]]
    """Every unmarked cell that launches a library's training, with the call, in order."""
    hints: list[str]
    """What the engines say to do where none does."""


def _launchings(notebook: Notebook, read: dict[int, ExportedCell | CellError]) -> _Launches:
    candidates = [cell for cell in notebook.code_cells if cell.role is None]
    codes = [e.code if isinstance(e := read[cell.number], ExportedCell) else None for cell in candidates]
    launches = read_launches(codes)
    return _Launches([(candidates[index], call) for index, call in launches.found], launches.hints)


class _Closure:
    """The setup cells chosen so far, and the names still to resolve."""

    def __init__(self, notebook: Notebook, before: list[Cell], read: dict[int, ExportedCell | CellError],
                 names: dict[int, CellNames | None], training: Cell, launch: str) -> None:
        self.notebook, self.before, self.training, self.launch = notebook, before, training, launch
        self.read = read
        self.names = names
        self.numbers: set[int] = set()
        self.why: dict[int, str] = {}
        """Why each cell was chosen (for a refusal that names it)."""
        self.pending: list[tuple[int, str]] = []
        self.resolved: set[tuple[int, str]] = set()
        self.problems: list[str] = []
        """Why the choice isn't safe, once every name is resolved (so a refusal lists the whole setup)."""

    def include(self, cell: Cell, why: str) -> None:
        if cell.number in self.numbers:
            return
        self.numbers.add(cell.number)
        self.why[cell.number] = why
        names = self.names[cell.number]
        if names is not None:
            self.need(cell.number, names.needs)

    def need(self, reader: int, names: Sequence[str]) -> None:
        self.pending.extend((reader, name) for name in names)

    def settle(self) -> None:
        while self.pending:
            reader, name = self.pending.pop()
            if (reader, name) not in self.resolved:
                self.resolved.add((reader, name))
                self._resolve(reader, name)

    def _resolve(self, reader: int, name: str) -> None:
        """Choose the cells before ``reader`` that ``name``'s value there comes from (or changes in)."""
        earlier = [c for c in reversed(self.before) if c.number < reader]
        changers = []
        for cell in earlier:
            names = self.names[cell.number]
            if names is None:
                continue
            why = f"it defines {name!r}, which cell {reader} needs"
            if names.star_import and name not in names.defines:
                self.include(cell, f"its star import may define {name!r}, which cell {reader} needs")
                continue
            if name in names.defines:
                self.include(cell, why)
                if name not in names.imports:  # a module's calls change no state of the notebook's
                    for changer in changers:
                        self.include(changer, f"it changes {name!r}, which cell {reader} needs")
                if name in names.surely_defines:
                    return
            elif name in names.changes:
                changers.append(cell)
        self._unresolved(reader, name)

    def _unresolved(self, reader: int, name: str) -> None:
        """``name`` comes from no earlier cell nbddp can read: a kernel's own name, a cell it can't read, or
        nowhere (then the kernel would fail too, and the run's check names it: nothing to decide here)."""
        reading = self.names.get(reader)
        if name in KERNEL_ONLY and reader in self.why and reading is not None and name in reading.kernel_only:
            self.problems.append(
                f"cell {reader}, which it needs because {self.why[reader]}, also uses {name!r}, which only a "
                "notebook kernel has (every rank would fail with a NameError). Move that line into a cell of its "
                "own, or mark the cells yourself")
            return
        unreadable = [c for c in self.before if c.number < reader and self.names[c.number] is None
                      and (re.search(rf"\b{re.escape(name)}\b", c.source) or re.search(r"%run\b", c.source))]
        if unreadable:
            cell = unreadable[-1]
            error = str(self.read[cell.number])
            line = error.rsplit("\n", 1)[-1].strip()
            why = error.split("\n")[0].split(": ", 2)[-1].split(". ")[0].rstrip(".")
            self.problems.append(
                f"cell {reader} needs {name!r}, which no earlier cell that nbddp can export defines; cell "
                f"{cell.number} may, but can't be exported ({line!r}: {why}). Rewrite that code in Python, or mark "
                "the cells yourself")

    def refusal(self, what: str) -> str:
        setup = sorted(self.numbers)
        cells = f"cell {setup[0]}" if len(setup) == 1 else f"cells {_numbers(setup)}" if setup else "the cells it needs"
        return (f"{self.notebook.path}: no cell is marked, and nbddp can't choose the setup of cell "
                f"{self.training.number} ({self.launch}), the training cell: {what}: start cell "
                f"{self.training.number} with '#| ddp-train' and {cells} (and any other cell the training "
                "needs) with '#| ddp', or tag them 'ddp-train' / 'ddp'; cells without a mark run only in the kernel.")


def no_training_cell(notebook: Notebook, hints: Sequence[str] | None = None) -> str:
    """What to mark, when nothing trains: the cell that trains, and the cells it needs. ``hints`` (no cell is
    marked): what the engines say to do, so also what nbddp would have recognised, and a cell that looks like a
    training loop."""
    text = (f"{notebook.path}: no training cell. Mark the cell that trains: start it with '#| ddp-train' "
            "(or tag it 'ddp-train', or make it a '%%ddp_train' cell), and mark the cells it needs (imports, data, "
            "model) with '#| ddp' (or tag them 'ddp'); cells without a mark run only in the kernel.")
    if hints is None:
        return text + see("no-training-cell")
    loop = next((cell for cell in notebook.code_cells if re.search(r"\.backward\(|\.step\(\)", cell.source)), None)
    hint = f" Cell {loop.number} calls .backward() or .step(): if it is the training, mark it so." if loop else ""
    return (text + hint + " (No cell is marked, and none launches a library's training that nbddp recognises "
            f"unmarked: {', '.join(launch_texts())}.)" + "".join(f" {line}" for line in hints)
            + see("no-training-cell"))


def _names(exported: ExportedCell | CellError) -> CellNames | None:
    return cell_names(exported.code) if isinstance(exported, ExportedCell) else None


def _note(training: int, launch: str, setup: list[int], kernel_only: list[int]) -> str:
    """``no cell is marked: cell 7 (trainer.fit) is the training cell, cells 2, 3, 5 its setup; …``"""
    if not setup:
        setup_text = "with no setup"
    else:
        setup_text = (f"cell {setup[0]}" if len(setup) == 1 else f"cells {_numbers(setup)}") + " its setup"
    rest = ""
    if kernel_only:
        rest = (f"; cell {kernel_only[0]} runs" if len(kernel_only) == 1 else f"; cells {_numbers(kernel_only)} run") \
            + " only in the kernel"
    return f"no cell is marked: cell {training} ({launch}) is the training cell, {setup_text}{rest}"


def _numbers(numbers: Sequence[int]) -> str:
    """``2, 3, 5, 8-12``: three or more consecutive numbers as a range, so a long notebook's line stays short."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs)
