"""A small kustomize: the features deploy/k8s uses, rendered offline in Python.

`resources` (files and directories with a kustomization.yaml), `namespace`, `images`
(newName, newTag) and `patches` given inline as JSON 6902 operations with a kind/name
target. Any other field of a kustomization fails, so a feature added to deploy/k8s is
added here too; test_k8s.py compares the output with `kubectl kustomize` where kubectl is
installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
Manifest = dict[str, Any]


def render(directory: Path) -> list[Manifest]:
    """The manifests `kubectl kustomize <directory>` prints, in resource order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    assert not unknown, f"{directory}: this renderer knows no {sorted(unknown)}"
    manifests: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            manifests += render(path)
        else:
            manifests += [m for m in yaml.safe_load_all(path.read_text()) if m]
    for patch in kustomization.get("patches", []):
        _patch(manifests, patch)
    for image in kustomization.get("images", []):
        for manifest in manifests:
            for container in _containers(manifest):
                container["image"] = _retag(container["image"], image)
    if "namespace" in kustomization:
        for manifest in manifests:
            manifest["metadata"]["namespace"] = kustomization["namespace"]
    return manifests


def _patch(manifests: list[Manifest], patch: dict[str, Any]) -> None:
    assert set(patch) == {"target", "patch"}, f"inline JSON 6902 patches only: {patch}"
    target = patch["target"]
    assert set(target) <= {"kind", "name"}, f"targets by kind and name only: {target}"
    hits = [
        m
        for m in manifests
        if m["kind"] == target.get("kind", m["kind"])
        and m["metadata"]["name"] == target.get("name", m["metadata"]["name"])
    ]
    assert hits, f"patch target matches nothing: {target}"
    for manifest in hits:
        for op in yaml.safe_load(patch["patch"]):
            _apply(manifest, op)


def _apply(document: Manifest, op: dict[str, Any]) -> None:
    """One JSON Patch (RFC 6902) operation: add, replace or remove."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
    if op["op"] == "remove":
        del node[key]
    elif op["op"] == "replace":
        assert (key < len(node)) if isinstance(node, list) else (key in node), op["path"]
        node[key] = copy.deepcopy(op["value"])
    elif op["op"] == "add":
        if isinstance(node, list):
            node.insert(key, copy.deepcopy(op["value"]))
        else:
            node[key] = copy.deepcopy(op["value"])
    else:
        raise AssertionError(f"this renderer knows no JSON patch op {op['op']!r}")


def _containers(manifest: Manifest) -> list[dict[str, Any]]:
    template = manifest.get("spec", {}).get("template", {}).get("spec", {})
    return [*template.get("initContainers", []), *template.get("containers", [])]


def _retag(image: str, rule: dict[str, str]) -> str:
    name, _, tag = image.partition(":")
    if name != rule["name"]:
        return image
    name = rule.get("newName", name)
    tag = rule.get("newTag", tag)
    return f"{name}:{tag}" if tag else name
