"""Profiles: a recipe's param changes by name, run as a DVC experiment; ``defect check`` before anything runs.

``params.yaml`` is the demonstration a fresh clone runs in minutes (``make run``). A profile,
``profiles/<name>.yaml``, holds what other data needs as dotted params keys and values, e.g.
``profiles/photographs.yaml``, the recipe measured on real photographs. One switch runs it::

    defect exp --profile photographs -S data.source=/data/tiles -S data.ok_class=good

The params it will run with (params.yaml, then the profile, then each ``-S``) are checked first, data
folder included; then ``dvc exp run -n NAME -S key=value ...`` writes the changed values into params.yaml,
runs the stages and keeps the experiment (``dvc exp show``, ``dvc exp apply NAME``). ``--queue`` queues
it in DVC's queue instead (``dvc queue start``), with the paths made absolute (a queued run works in a copy
of the project). ``defect check`` takes the same arguments and runs nothing: params, then the data folder
(every file decoded, the validate stage's gate), one line per problem.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.config import ConfigError, Params, apply_changes, checked_params
from pipeline.data.check import check_data

PROFILES_DIR = Path("profiles")


def profile_changes(name: str | None) -> dict:
    """The dotted-key changes of ``profiles/<name>.yaml`` (none for no profile)."""
    if not name:
        return {}
    path = PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"--profile {name}: {path} not found (profiles: {', '.join(known) or 'none'})")
    changes = yaml.safe_load(path.read_text()) or {}
    if not isinstance(changes, dict):
        raise ConfigError(f"{path}: expected a mapping of dotted params keys to values")
    return changes


def set_changes(sets: list[str]) -> dict:
    """``-S key=value`` arguments as changes; the value is read as YAML (``-S train.epochs=10`` is a number)."""
    changes = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"-S {item}: expected key=value, e.g. -S data.source=/data/images")
        changes[key.strip()] = yaml.safe_load(value) if value else ""
    return changes


def planned(profile: str | None, sets: list[str], root: Path = Path()) -> tuple[dict, dict, Params]:
    """(params.yaml as read, the params to run, the latter checked): a wrong key or value names itself."""
    now = yaml.safe_load((root / "params.yaml").read_text()) or {}
    raw = apply_changes(now, profile_changes(profile), f"profiles/{profile}.yaml")
    raw = apply_changes(raw, set_changes(sets), "-S")
    where = "params.yaml" + (f" + profiles/{profile}.yaml" if profile else "") + (" + -S" if sets else "")
    return now, raw, checked_params(raw, where)


def check_command(profile: str | None, sets: list[str]) -> int:
    """``defect check``: the params, then the data they name; 0 when the pipeline can run, 1 when not."""
    try:
        _, _, params = planned(profile, sets)
    except ConfigError as exc:
        print(f"params: {exc}")
        return 1
    print(f"params: ok ({params.source_file})")
    problems = check_data(params)
    for line in problems:
        print(f"problem: {line}")
    print("ready: dvc repro" if not problems else f"{len(problems)} problem(s): fix them, then run defect check again")
    return 1 if problems else 0


def exp_command(profile: str | None, sets: list[str], name: str | None, queue: bool, dry_run: bool) -> int:
    """``defect exp``: the checked params run (or queued) as one DVC experiment."""
    from pipeline.sweep import absolute_paths, dvc, set_params  # dvc's imports only when running one

    now, raw, params = planned(profile, sets)
    if check_data(params) and not dry_run:
        print("defect exp: the data has problems (above); `defect check` lists them", flush=True)
        return 1
    if queue:
        raw = absolute_paths(raw, Path.cwd())
    args = ["exp", "run", *(["-n", name] if name else []), *(["--queue"] if queue else [])]
    args += [a for change in set_params(now, raw) for a in ("-S", change)]
    print("dvc " + " ".join(args), flush=True)
    if not dry_run:
        dvc(*args, stream=True)
    return 0
