"""An option declared once, as a field of the frozen options it sets; every door's form of it is derived.

A launch option is one ``dataclasses`` field declared with an :class:`Option`'s :meth:`~Option.field`
(``nbddp.plan.options.option``): its name and type are the field's, its default is the field's default, and
the :class:`Option` in its metadata says the rest: its flags, help, group and metavar, how a value
given in Python becomes the field's (``coerce``), the check that refuses a bad value naming the
flag, and which doors take it. As torchrun's ``env`` argparse action declares a flag, its variable
and its default in one place, so that its one ``LaunchConfig`` is what both its command line and its
Python API build.

Everything a door needs is derived here from those declarations, for any such dataclass:
:func:`add_arguments` (a door's argparse arguments), :func:`values_from` (what they parsed, as the
dataclass's keywords), :func:`to_argv` (the same options as arguments again), :func:`takes_options`
(a Python function's typed keywords) and :func:`markdown_rows` (the README's table). Nothing here
knows a particular option (they are declared in :mod:`nbddp.plan.options`), and nothing imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import textwrap
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator, Sequence

from nbddp.contracts.errors import UsageError

#: The key of a field's :class:`Option` in ``dataclasses.field(metadata=...)``.
OPTION = "nbddp.option"
#: No default: the option must be given (``dataclasses.MISSING`` can't be a dataclass field's own default).
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()


@dataclass(frozen=True)
class Option:
    """How one field is given: on a command line, as a Python keyword, and how it is checked.

    Callables take the value first and the option's :attr:`name` second, so that what they say
    names the flag the user typed (``--nproc 0: need at least 1 process.``).
    """

    flags: tuple[str, ...]
    """``("--gpus",)``; ``("-p", "--parameter")``; ``()`` for an option made only of its ``of``'s options."""
    help: str = ""
    group: str = ""
    """The ``--help`` section it is listed in."""
    doors: frozenset[str] = frozenset()
    """The front doors that take it (a door's Python function takes what its command takes)."""
    default: Any = REQUIRED
    default_factory: Callable[[], Any] | None = None
    metavar: str | tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None
    """argparse's ``type`` (``int``, ``float``, ``Path``): a value it can't convert is argparse's error."""
    action: Any = None
    """argparse's ``action`` (``"store_true"``, ``"append"``, ``argparse.BooleanOptionalAction``)."""
    nargs: int | str | None = None
    const: Any = None
    choices: tuple[str, ...] | None = None
    """The values it may take, on the command line (argparse's ``choices``) and in Python alike."""
    parse: Callable[[Any, str], Any] | None = None
    """What argparse gave (``-p``'s pairs of text) → the field's value."""
    coerce: Callable[[Any], Any] | None = None
    """Any value given in Python (``gpus=2``, ``returns="a,b"``, ``None``) → the field's value; applied whenever
    the dataclass is made, so it must keep a value it already made as it is."""
    check: Callable[[Any, str], None] | None = None
    """Raises :class:`~nbddp.contracts.errors.UsageError` naming the flag for a value that can never work (never for
    None)."""
    render: Callable[[Any, str], list[str]] | None = None
    """The field's value → arguments that parse back to it (default: ``[flag, str(value)]``)."""
    accepts: str | None = None
    """The type a Python keyword takes, where it is wider than the field's (``int | str | None`` for ``gpus``)."""
    example: tuple[str, ...] = ()
    """Words after the flag that give a value other than the default (the tests give it to every door)."""
    of: type | None = None
    """A dataclass whose own option fields make this option's value (``--slurm`` and its ``--partition``…)."""
    sets: str | None = None
    """With ``of``: the field of ``of`` that this option's own flag sets (``--ray ADDRESS``)."""
    build: Callable[[dict[str, Any]], Any] | None = None
    """With ``of`` and no flag of its own: its value from the fields given (default: ``of(**given)``)."""

    @property
    def name(self) -> str:
        """How messages name it: ``--nproc``, ``-p``, ``--requeue/--no-requeue``."""
        if self.action is argparse.BooleanOptionalAction:
            return f"{self.flags[0]}/--no-{self.flags[0][2:]}"
        return self.flags[0] if self.flags else ""

    def field(self) -> Any:
        """The ``dataclasses.field`` that declares this option (its default is the field's)."""
        if self.default_factory is not None:
            return dataclasses.field(default_factory=self.default_factory, metadata={OPTION: self})
        return dataclasses.field(default=MISSING if self.default is REQUIRED else self.default, metadata={OPTION: self})


@dataclass(frozen=True)
class Declared:
    """One declared field, where it stands: its dataclass's field, and the option it belongs to (if nested)."""

    field: dataclasses.Field
    parent: "Declared | None" = None

    @property
    def option(self) -> Option:
        return self.field.metadata[OPTION]

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def dest(self) -> str:
        """argparse's ``dest``: the field's name; a nested option's, its flag's (one ``--nodes`` for Slurm and Ray)."""
        if self.parent is None or not self.option.flags:
            return self.name
        return self.option.flags[-1].lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return self.field.default

    def keyword(self) -> str:
        """How Python gives it: ``gpus=``, ``slurm=SlurmRequest(partition=)``."""
        if self.parent is None:
            if self.option.of is None:
                return f"{self.name}="
            return f"{self.name}={self.option.of.__name__}({f'{self.option.sets}=' if self.option.sets else ''})"
        return f"{self.parent.name}={self.parent.option.of.__name__}({self.name}=)"


def fields_of(cls: type) -> list[Declared]:
    """``cls``'s option fields, in order (its other fields, such as ``RayRequest.address``, are not options)."""
    return [Declared(f) for f in dataclasses.fields(cls) if OPTION in f.metadata]


def declared(cls: type) -> Iterator[Declared]:
    """Every option ``cls`` declares, its nested ones after the option they belong to."""
    for top in fields_of(cls):
        yield top
        if top.option.of is not None:
            for inner in fields_of(top.option.of):
                yield Declared(inner.field, top)


def usage(declaration: Declared) -> str:
    """``--gpus N|all``, ``-p NAME VALUE``, ``--ray [ADDRESS]``, ``--requeue``: the option as typed."""
    option = declaration.option
    if option.action in ("store_true", argparse.BooleanOptionalAction) or not option.flags:
        return option.name
    metavar = option.metavar or ("|".join(option.choices) if option.choices else declaration.dest.upper())
    words = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    return f"{option.flags[0]} [{words}]" if option.nargs == "?" else f"{option.flags[0]} {words}"


def takes(declaration: Declared, door: str) -> bool:
    """Whether ``door`` takes the option (a nested one: where it takes the option it belongs to, too)."""
    parent = declaration.parent
    return door in declaration.option.doors and (parent is None or door in parent.option.doors)


def check_fields(obj: Any) -> None:
    """Coerce and check each of ``obj``'s option fields (from its ``__post_init__``): each option's own rule."""
    for declaration in fields_of(type(obj)):
        option, value = declaration.option, getattr(obj, declaration.name)
        if option.coerce is not None:
            value = option.coerce(value)
            object.__setattr__(obj, declaration.name, value)
        if value is None:
            continue
        if option.choices is not None and value not in option.choices:
            raise UsageError(f"{option.name} {value}: choose one of {', '.join(option.choices)}.")
        if option.check is not None:
            option.check(value, option.name)


# ---------------------------------------------------------------- the command line


def in_help_order(cls: type, groups: Sequence[str], door: str | None = None) -> list[list[Declared]]:
    """``cls``'s options as ``--help`` lists them (by ``groups``, then as declared), with a flag of their own, each
    with every place it is declared in (``--nodes``: ``SlurmRequest.nodes`` and ``RayRequest.nodes``); only those
    ``door`` takes, if given."""
    places: dict[str, list[Declared]] = {}
    for declaration in declared(cls):
        if declaration.option.flags and (door is None or takes(declaration, door)):
            places.setdefault(declaration.dest, []).append(declaration)
    unknown = {found[0].option.group for found in places.values()} - set(groups)
    if unknown:
        raise ValueError(f"options in groups with no place in --help: {sorted(unknown)}")
    return [found for title in groups for found in places.values() if found[0].option.group == title]


def add_arguments(parser: argparse.ArgumentParser, cls: type, door: str, groups: Sequence[str],
                  only: Sequence[str] = ()) -> None:
    """The arguments of every option of ``cls`` that ``door`` takes, in ``groups``' order (``--help``'s sections);
    ``only``: those of these sections alone (``nbddp doctor`` takes where a run's ranks run, not what they run).

    An option not given is left out of the parsed namespace (``argparse.SUPPRESS``), so that its default is
    the dataclass's alone and :func:`values_from` knows what was given.
    """
    made: dict[str, Any] = {}
    for declaration, *_ in in_help_order(cls, groups, door):
        option = declaration.option
        if only and option.group not in only:
            continue
        if option.group not in made:
            made[option.group] = parser.add_argument_group(option.group)
        made[option.group].add_argument(*option.flags, dest=declaration.dest, default=argparse.SUPPRESS,
                                        **_argparse_keywords(option))


def _argparse_keywords(option: Option) -> dict[str, Any]:
    given = {"help": option.help or None, "metavar": option.metavar, "type": option.type, "action": option.action,
             "nargs": option.nargs, "const": option.const, "choices": option.choices}
    return {key: value for key, value in given.items() if value is not None}


def values_from(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """``cls``'s keywords from what :func:`add_arguments` parsed: the options given, each as its field's value.

    Raises:
        UsageError: an option of ``--slurm`` (say) given without it.
    """
    given = vars(args)
    _refuse_unclaimed(cls, given)
    values: dict[str, Any] = {}
    for top in fields_of(cls):
        option = top.option
        if option.of is None:
            if top.dest in given:
                values[top.name] = _parsed(top, given)
            continue
        inner = {d.name: _parsed(d, given) for d in declared(cls) if d.parent == top and d.dest in given}
        if option.flags:  # (--slurm, --ray [ADDRESS]): made when its own flag is given
            if top.dest in given:
                if option.sets:
                    inner[option.sets] = given[top.dest]
                values[top.name] = option.of(**inner)
        elif inner:  # (--nnodes, --node-rank, --rdzv-endpoint): made of what was given
            values[top.name] = option.build(inner) if option.build else option.of(**inner)
    return values


def _parsed(declaration: Declared, given: dict[str, Any]) -> Any:
    option, value = declaration.option, given[declaration.dest]
    return option.parse(value, option.name) if option.parse else value


def _refuse_unclaimed(cls: type, given: dict[str, Any]) -> None:
    """An option that belongs to ``--slurm`` (or to ``--slurm`` and ``--ray``) given without it."""
    owners: dict[str, list[Declared]] = {}  # dest → the options with a flag of their own it belongs to
    names: dict[str, str] = {}
    for declaration in declared(cls):
        if declaration.parent is not None and declaration.parent.option.flags:
            owners.setdefault(declaration.dest, []).append(declaration.parent)
            names[declaration.dest] = declaration.option.name
    unclaimed: dict[tuple[str, ...], list[str]] = {}
    for dest, parents in owners.items():
        if dest in given and not any(parent.dest in given for parent in parents):
            unclaimed.setdefault(tuple(parent.option.name for parent in parents), []).append(names[dest])
    if unclaimed:
        gates, flags = next(iter(unclaimed.items()))
        raise UsageError(f"{', '.join(flags)}: only with {' or '.join(gates)}.")


def to_argv(obj: Any) -> list[str]:
    """Arguments that :func:`add_arguments`' parser parses back to ``obj``: each option that isn't its default."""
    argv: list[str] = []
    for declaration in fields_of(type(obj)):
        value = getattr(obj, declaration.name)
        if value != declaration.default:
            argv += _render(declaration.option, value)
    return argv


def _render(option: Option, value: Any) -> list[str]:
    if option.of is not None:
        own = list(option.flags)
        if option.sets and getattr(value, option.sets) != _default(option.of, option.sets):  # (--ray ADDRESS)
            own.append(str(getattr(value, option.sets)))
        return own + to_argv(value)
    if option.render is not None:
        return option.render(value, option.name)
    if option.action == "store_true":
        return [option.flags[-1]] if value else []
    if option.action is argparse.BooleanOptionalAction:
        return [option.flags[0] if value else f"--no-{option.flags[0][2:]}"]
    return [option.flags[-1], str(value)]


def _default(cls: type, name: str) -> Any:
    (found,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return Declared(found).default


# ---------------------------------------------------------------- Python keywords


def keyword_parameters(cls: type, door: str) -> list[inspect.Parameter]:
    """``cls``'s options that ``door`` takes, as keyword-only parameters with their types and defaults."""
    return [inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=d.default,
                              annotation=d.option.accepts or d.field.type)
            for d in fields_of(cls) if takes(d, door)]


def takes_options(cls: type, door: str, into: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A function whose keyword ``into`` (a ``cls``) is taken as the typed keywords of ``door``'s options.

    The function shows (``help()``, ``inspect.signature``, an editor's hints) each option as a keyword of
    its own, with its type and default, and its docstring lists them; a call builds the one ``cls`` from the
    keywords given, checked as every door checks it, and passes it as ``into``. An unknown keyword is the
    ``TypeError`` Python raises, with the nearest option named.
    """

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(function)
        options = keyword_parameters(cls, door)
        signature = own.replace(parameters=[*(p for p in own.parameters.values() if p.name != into), *options])
        names = {p.name for p in options}

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{function.__name__}() {exc}{_nearest(kwargs, signature)}") from None
            given = {name: value for name, value in bound.arguments.items() if name in names}
            rest = {name: value for name, value in bound.arguments.items() if name not in names}
            return function(**rest, **{into: cls(**given)})

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        wrapper.__annotations__ = {**{p.name: p.annotation for p in signature.parameters.values()
                                      if p.annotation is not p.empty},
                                   **({"return": own.return_annotation} if own.return_annotation is not own.empty
                                      else {})}
        wrapper.__doc__ = inspect.cleandoc(function.__doc__ or "") + "\n\n" + _keywords_doc(cls, door)
        return wrapper

    return decorate


def _nearest(kwargs: dict[str, Any], signature: inspect.Signature) -> str:
    unknown = [name for name in kwargs if name not in signature.parameters]
    close = difflib.get_close_matches(unknown[0], signature.parameters, n=1) if unknown else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def _keywords_doc(cls: type, door: str) -> str:
    """The docstring's list of the option keywords: each with its flag and its help, wrapped."""
    what = (inspect.getdoc(cls) or cls.__name__).split("(")[0].split(":")[0].strip().rstrip(".")
    lines = [f"{cls.__name__}, {what[0].lower()}{what[1:]} (each flag of ``{door}``, as a keyword):"]
    for top in fields_of(cls):
        if not takes(top, door):
            continue
        option = top.option
        inner = [usage(d) for d in declared(cls) if d.parent == top]
        said = f"{usage(top)}: {option.help}" if option.help else ""
        if inner:
            said += f"{'; ' if said else ''}{option.of.__name__}: {', '.join(inner)}"
        lines += textwrap.wrap(f"{top.name}: {said}", 110, initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)


# ---------------------------------------------------------------- documentation


def markdown_rows(cls: type, groups: Sequence[str], doors: Sequence[str]) -> list[str]:
    """A Markdown table of ``cls``'s options, as ``--help`` lists them: as typed, from Python, what it does, and
    which of ``doors`` take it."""
    rows = ["| option | from Python | what it does | taken by |", "|---|---|---|---|"]
    for places in in_help_order(cls, groups):
        declaration = places[0]
        missing = [door for door in doors if not takes(declaration, door)]
        cells = (f"`{usage(declaration)}`", ", ".join(f"`{place.keyword()}`" for place in places),
                 " ".join(declaration.option.help.replace("%%", "%").split()),
                 "every door but " + ", ".join(f"`{door}`" for door in missing) if missing else "every door")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # (GFM: even in `code`)
    return rows
