"""The top-level folders are layers: each imports only from the layers below it, never from a sibling
on its own layer, so there are no import cycles between them (docs/architecture.md, "Layers").

import-linter cannot see this layout (the folders are installed as `tide.*` through setuptools'
package-dir), so this reads every module's imports with `ast`. Run by `make lint`; exits 1 and lists
each import that goes the wrong way.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# highest first; a unit is a folder or a module, named by its path from the repository's root
LAYERS: list[list[str]] = [
    ["tide/cli.py"],
    ["tide/bench"],
    ["tide/stack.py", "tide/bootstrap.py"],
    ["serving"],
    ["registry"],
    ["trainers"],
    ["producers", "infra"],
    ["tide/config.py", "tide/names.py", "tide/prompts.py", "tide/__init__.py"],
    ["tide/models"],
]
# where each installed package comes from (pyproject's package-dir)
PACKAGE_DIRS = {
    "tide.serving": "serving",
    "tide.producers": "producers",
    "tide.trainers": "trainers",
    "tide.registry": "registry",
    "tide.infra": "infra",
    "tide": "tide",
}


def unit_of(path: str) -> str | None:
    for layer in LAYERS:
        for unit in layer:
            if path == unit or path.startswith(unit + "/"):
                return unit
    return None


def layer_of(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def path_of(module: str) -> str | None:
    """`tide.serving.engine` -> `serving/engine.py` (or the package's folder)."""
    for prefix, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) :].lstrip(".").replace(".", "/")
            base = f"{folder}/{rest}" if rest else folder
            if (ROOT / f"{base}.py").exists():
                return f"{base}.py"
            return base
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every `import tide...` and `from tide... import name` in the file."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tide"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tide"):
            # `from tide import serving` names a package, `from tide.x import y` a symbol or a module
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def violations() -> list[str]:
    found: list[str] = []
    for layer in LAYERS:
        for unit in layer:
            files = [ROOT / unit] if unit.endswith(".py") else sorted((ROOT / unit).rglob("*.py"))
            for f in files:
                here = f.relative_to(ROOT).as_posix()
                for line, module in imports(f):
                    target = path_of(module)
                    while target and unit_of(target) is None and "/" in target:
                        target = target.rsplit("/", 1)[0]  # `tide.x.name`: the name is a symbol
                    other = unit_of(target) if target else None
                    if other is None or other == unit:
                        continue
                    if layer_of(other) <= layer_of(unit):
                        found.append(
                            f"{here}:{line}: imports {module} ({other}, not a lower layer than {unit})"
                        )
    return found


def main() -> int:
    found = violations()
    for v in found:
        print(v)
    print(f"layers: {len(found)} imports go the wrong way" if found else "layers: ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
