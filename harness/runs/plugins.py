"""A researcher's own rules without editing ratiolab: plugins, imported in every process that
builds a run, and the config group options the registries give.

A plugin is a module (`my_pkg.rules`) or a `.py` file (loaded by its path; a relative path is
taken from the working directory) that registers builders with the registries' decorator:

    from harness.base.registry import register
    from harness.objectives import OBJECTIVES

    @register(OBJECTIVES, "my_clip")
    class MyClip(Objective): ...

Two sources, each imported once per process: the `plugins` config key (a list) and the
`ratiolab.plugins` entry-point group of the installed distributions (importlib.metadata), so a
pip-installed plugin needs no key. The entry points run the CLIs before Hydra composes (the
command line's `plugins=` is read first, `from_argv`, so `objective=my_clip` resolves), and
`harness.runs.launch.run_task` again from the composed config in the local launcher's workers,
the Slurm jobs and the torchrun ranks, before any check.

After every import, each registry name without a file of its own under experiments/<group>/
becomes an option of its config group (`store_groups`): `objective=my_clip` selects
`{name: my_clip}`, and `objective.<kw>=` is checked against the builder's signature before any
compute (harness.runs.validate.check_nodes). A noise builder that takes a `seed` gets
`seed: ${seed}`: its noise field follows the run's seed, so arms paired by seed share one field.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override

from harness import CONFIGS

ENTRY_POINTS = "ratiolab.plugins"

# what this process imported: the plugin as named -> {plugin, file, sha256}
_LOADED: dict[str, dict[str, str]] = {}
_ENTRY_POINTS_DONE = False


class PluginError(ImportError):
    pass


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import_file(path: Path) -> ModuleType:
    """A `.py` file as a module named by its stem and its path's hash (two files of one stem do
    not collide), in sys.modules as `import` would put it: its classes pickle by reference, and
    every process that loads the same file gives the module the same name."""
    name = f"ratiolab_plugin_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(plugin: str) -> dict[str, str]:
    """Import one plugin; its record {plugin, file, sha256}."""
    try:
        if plugin.endswith(".py"):
            path = Path(plugin).expanduser().absolute()
            if not path.is_file():
                raise PluginError(
                    f"plugins: {plugin!r}: no such file ({path}); valid: a .py file (a relative "
                    "path is taken from the working directory) or an importable module name"
                )
            module = _import_file(path)
        else:
            module = importlib.import_module(plugin)
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"plugins: {plugin!r} failed to import: {type(e).__name__}: {e}") from e
    file = Path(module.__file__).resolve() if getattr(module, "__file__", None) else None
    return {
        "plugin": plugin,
        "file": str(file) if file else None,
        "sha256": sha256(file) if file else None,
    }


def _entry_points() -> list[dict[str, str]]:
    records = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.module in _LOADED:
            continue
        try:
            ep.load()
        except Exception as e:
            raise PluginError(
                f"entry point {ep.name} = {ep.value!r} ({ENTRY_POINTS}, distribution "
                f"{ep.dist.name if ep.dist else '?'}) failed to import: {type(e).__name__}: {e}"
            ) from e
        records.append(_import(ep.module))  # loaded: its record only
    return records


def load(plugins: Iterable[str] | str | None = ()) -> list[dict[str, str]]:
    """Import the entry points (first call) and `plugins` (each once per process; a file by its
    absolute path), then store the group options; the records of every plugin loaded so far."""
    global _ENTRY_POINTS_DONE
    if not _ENTRY_POINTS_DONE:
        for record in _entry_points():
            _LOADED[record["plugin"]] = record
        _ENTRY_POINTS_DONE = True
    for plugin in [plugins] if isinstance(plugins, str) else list(plugins or ()):
        key = str(Path(plugin).expanduser().absolute()) if plugin.endswith(".py") else plugin
        if key not in _LOADED:
            _LOADED[key] = {**_import(plugin), "plugin": key}
    store_groups()
    return loaded()


def loaded() -> list[dict[str, str]]:
    return sorted(_LOADED.values(), key=lambda r: r["plugin"])


def load_config(cfg: Any) -> list[dict[str, str]]:
    """The plugins a composed config names (its `plugins` key), before anything checks it."""
    return load(list(cfg.get("plugins") or ()))


def from_argv(argv: list[str]) -> list[str]:
    """The plugins a command line names (`plugins=a.py`, `plugins=[a.py,pkg.mod]`, `+plugins=…`),
    parsed as Hydra parses overrides, for the imports before composition; a sweep over plugins
    imports every one."""
    wanted = [a for a in argv if a.lstrip("+~").partition("=")[0] == "plugins"]
    out: list[str] = []
    for override in OverridesParser.create().parse_overrides(wanted):
        out += _values(override)
    return out


def _values(override: Override) -> list[str]:
    if override.is_delete():
        return []
    if override.is_sweep_override():
        values = list(override.sweep_iterator())
    else:
        values = [override.value()]
    flat: list[str] = []
    for v in values:
        flat += [str(x) for x in v] if isinstance(v, list) else [str(v)]
    return flat


# --- the config group options of the registries -----------------------------------------------


def registries() -> dict[str, dict[str, Callable]]:
    from harness.noise import NOISE
    from harness.objectives import AGGREGATIONS, OBJECTIVES
    from harness.tasks import TASKS

    return {"objective": OBJECTIVES, "aggregation": AGGREGATIONS, "noise": NOISE, "task": TASKS}


def group_node(group: str, name: str, builder: Callable) -> dict[str, Any]:
    """The option `group=name`: the registry key, and a noise field that follows the run's seed."""
    import inspect

    node: dict[str, Any] = {"name": name}
    if group == "noise" and "seed" in inspect.signature(builder).parameters:
        node["seed"] = "${seed}"
    return node


def store_groups() -> None:
    """Every registry name as an option of its group, unless experiments/<group>/<name>.yaml
    sets more (Hydra would match the file against a stored node of the same name)."""
    store = ConfigStore.instance()
    for group, table in registries().items():
        for name, builder in table.items():
            if not (CONFIGS / group / f"{name}.yaml").exists():
                store.store(group=group, name=name, node=group_node(group, name, builder))
