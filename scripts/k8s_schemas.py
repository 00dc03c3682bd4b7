"""JSON schemas for kubeconform, written offline: Kubernetes' own OpenAPI spec (from the
k8s.io/kubernetes module on the Go module proxy) and CRDs (KEDA's ScaledObject), one file per
kind as `<kind>_<group>_<version>.json`, with every $ref inlined and unknown fields refused, as in
the schemas kubeconform downloads by default (which this machine cannot reach).

usage: python scripts/k8s_schemas.py --swagger swagger.json --crd crd.yaml ... --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def _strict(node: Any) -> Any:
    """kubectl's validation: objects with properties refuse other keys; int-or-string is either."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if node.get("format") == "int-or-string":
            node = {k: v for k, v in node.items() if k not in ("format", "type")}
            node["oneOf"] = [{"type": "string"}, {"type": "integer"}]
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/definitions/"):
            name = ref.removeprefix("#/definitions/")
            if name in seen:  # recursive types (JSONSchemaProps): accept anything below
                return {}
            return _inline(defs[name], defs, (*seen, name))
        return {k: _inline(v, defs, seen) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs, seen) for v in node]
    return node


def _write(out: Path, kind: str, group: str, version: str, schema: dict[str, Any]) -> None:
    # kubeconform's {{ .Group }} is the first part of apiVersion: "v1" for the core group
    name = f"{kind}_{group or version}_{version}.json".lower()
    (out / name).write_text(json.dumps(schema))


def from_swagger(path: Path, out: Path) -> int:
    defs = json.loads(path.read_text())["definitions"]
    # quantities are strings in the spec, but the API (and kubectl) take numbers too: `nvidia.com/gpu: 1`
    quantity = "io.k8s.apimachinery.pkg.api.resource.Quantity"
    defs[quantity] = {**defs[quantity], "oneOf": [{"type": "string"}, {"type": "number"}]}
    defs[quantity].pop("type", None)
    n = 0
    for name, d in defs.items():
        for gvk in d.get("x-kubernetes-group-version-kind", []):
            if name.endswith((".DeleteOptions", ".WatchEvent")):
                continue  # listed under every group; not manifests
            schema = _strict(_inline(d, defs, (name,)))
            schema["$schema"] = "http://json-schema.org/schema#"
            _write(out, gvk["kind"], gvk["group"], gvk["version"], schema)
            n += 1
    return n


def from_crd(path: Path, out: Path) -> int:
    n = 0
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for v in spec["versions"]:
            schema = _strict(v["schema"]["openAPIV3Schema"])
            _write(out, spec["names"]["kind"], spec["group"], v["name"], schema)
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swagger", type=Path, required=True)
    ap.add_argument("--crd", type=Path, action="append", default=[])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    n = from_swagger(args.swagger, args.out) + sum(from_crd(c, args.out) for c in args.crd)
    print(f"{n} schemas in {args.out}")


if __name__ == "__main__":
    main()
