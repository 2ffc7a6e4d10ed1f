"""The deploy manifests validate against the schemas of what reads them: deploy/rayjob.yaml and
deploy/rayservice.yaml against KubeRay's v1 CRD schemas (tests/schemas/kuberay/, see its README),
deploy/cluster.yaml against the cluster-launcher schema Ray ships. Besides JSON-schema errors (types,
enums, required keys) every key the schema does not name is reported with its path: a CRD's schema
rarely forbids unknown keys, and the Kubernetes API server drops them silently (a typo in
`backoffLimit` would just turn retries off)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from batch_fixtures import REPO

SCHEMAS = Path(__file__).parent / "schemas" / "kuberay"


def ray_cluster_schema() -> dict:
    import ray

    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def load_schema(name: str) -> dict:
    return ray_cluster_schema() if name == "ray" else json.loads((SCHEMAS / f"{name}.v1.schema.json").read_text())


MANIFESTS = {"rayjob.yaml": "RayJob", "rayservice.yaml": "RayService", "cluster.yaml": "ray"}


def load_manifest(name: str) -> dict:
    return yaml.safe_load((REPO / "deploy" / name).read_text())


def dotted(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def schema_errors(doc, schema: dict) -> list[str]:
    """JSON-schema errors as 'path: message'."""
    errors = jsonschema.Draft7Validator(schema).iter_errors(doc)
    return sorted(f"{dotted(e.absolute_path) or '<root>'}: {e.message}" for e in errors)


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:  # Ray's schema uses local refs (#/definitions/...); the CRDs none
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _value_schema(key: str, schema: dict):
    """The schema for `key` of an object, True when any value is allowed unchecked, None when unknown."""
    if key in schema.get("properties", {}):
        return schema["properties"][key]
    for pattern, sub in schema.get("patternProperties", {}).items():
        if re.search(pattern, key):
            return sub
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        return extra  # a map (labels, rayStartParams, resource limits): its values are still checked
    free_form = extra is True or not ("properties" in schema or "patternProperties" in schema)
    return True if free_form else None


def unknown_keys(doc, schema: dict, root: dict | None = None, path: tuple = ()) -> list[str]:
    """Paths of keys in `doc` that the schema does not name. Skipped: subtrees marked
    x-kubernetes-preserve-unknown-fields and objects without any declared keys (free-form)."""
    root = schema if root is None else root
    schema = _resolve(schema, root)
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            sub = _value_schema(key, schema)
            if sub is None:
                found.append(dotted(path + (key,)))
            elif sub is not True:
                found += unknown_keys(value, sub, root, path + (key,))
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(doc):
            found += unknown_keys(item, schema["items"], root, path + (i,))
    return found


def problems(doc, schema: dict) -> list[str]:
    return schema_errors(doc, schema) + [f"{p}: unknown key" for p in unknown_keys(doc, schema)]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_valid(name):
    assert problems(load_manifest(name), load_schema(MANIFESTS[name])) == []


def _set(doc: dict, path: str, value):
    """Set (or add) the value at a dotted path with [i] list indices."""
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]
    node = doc
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value


# (manifest, path, value, what the report must say): each check can fail, and names where.
BROKEN = [
    ("rayjob.yaml", "spec.backofLimit", 2, "spec.backofLimit: unknown key"),
    ("rayjob.yaml", "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].resource", {},
     "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].resource: unknown key"),
    ("rayjob.yaml", "spec.backoffLimit", "two", "spec.backoffLimit: 'two' is not of type 'integer'"),
    ("rayjob.yaml", "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus", 0,
     "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'"),
    ("rayservice.yaml", "spec.rayClusterConfig.workerGroupSpecs[0].maxReplica", 4,
     "spec.rayClusterConfig.workerGroupSpecs[0].maxReplica: unknown key"),
    ("rayservice.yaml", "spec.rayClusterConfig.workerGroupSpecs[0].replicas", "1",
     "spec.rayClusterConfig.workerGroupSpecs[0].replicas: '1' is not of type 'integer'"),
    ("cluster.yaml", "available_node_types.gpu_worker.max_worker", 8,
     "available_node_types.gpu_worker.max_worker: unknown key"),
    ("cluster.yaml", "available_node_types.gpu_worker.max_workers", "8",
     "available_node_types.gpu_worker.max_workers: '8' is not of type 'integer'"),
]


@pytest.mark.parametrize("name, path, value, expected", BROKEN, ids=[b[1] for b in BROKEN])
def test_a_broken_manifest_is_reported_with_its_path(name, path, value, expected):
    doc = load_manifest(name)
    _set(doc, path, value)
    assert expected in problems(doc, load_schema(MANIFESTS[name]))


def test_unknown_key_walk_skips_free_form_and_checks_maps():
    schema = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "raw": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "any": {"type": "object"},
        "limits": {"type": "object", "additionalProperties": {"type": "object", "properties": {"cpu": {}}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}}}}
    doc = {"labels": {"app": "x"}, "raw": {"anything": {"deep": 1}}, "any": {"k": 1},
           "limits": {"a": {"cpu": 1, "gpu": 1}}, "items": [{"name": "a"}, {"nam": "b"}], "extra": 1}
    assert unknown_keys(doc, schema) == ["limits.a.gpu", "items[1].nam", "extra"]
