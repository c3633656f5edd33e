"""Builds a kustomization into the documents `kubectl apply -k` would send, so the deployment
tests check what a cluster receives rather than the files one by one, without a kustomize
binary. Only what ops/k8s uses is supported: `resources` (files, and directories that are
kustomizations themselves, in order) and `patches` that are inline JSON6902 with a `target`;
anything else in a kustomization is refused rather than ignored. It is stricter than
kustomize where kustomize is silent: a patch whose target selects nothing is an error here
(kustomize skips it, so an overlay whose base renamed a resource would quietly stop applying).
Like kustomize it refuses a file outside the kustomization's directory and a base directory
that contains the overlay loading it ("cycle detected")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonpatch
import jsonpointer
import yaml

Doc = dict[str, Any]

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}
TARGET_FIELDS = {"group", "version", "kind", "name"}


class KustomizeError(Exception):
    """The kustomization cannot be built; the message names the file and the problem."""


def render(directory: Path) -> list[Doc]:
    """The documents of the kustomization in `directory`, patched, in resource order."""
    return _build(directory.resolve(), ())


def _build(root: Path, visited: tuple[Path, ...]) -> list[Doc]:
    for seen in visited:
        if seen == root or root in seen.parents:
            raise KustomizeError(f"cycle detected: {root} contains {seen}, which loads it")
    path = root / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    kustomization = yaml.safe_load(path.read_text())
    if unknown := set(kustomization) - KUSTOMIZATION_FIELDS:
        raise KustomizeError(f"{path}: unsupported fields {sorted(unknown)}")
    docs: list[Doc] = []
    for name in kustomization.get("resources", []):
        resource = (root / name).resolve()
        if resource.is_dir():
            docs += _build(resource, (*visited, root))
        elif root in resource.parents:
            docs += _load(resource)
        else:
            raise KustomizeError(f"{path}: {name} is neither a directory nor in {root}")
    ids = [_id(doc) for doc in docs]
    if duplicates := {i for i in ids if ids.count(i) > 1}:
        raise KustomizeError(f"{path}: resources defined twice: {sorted(duplicates)}")
    for patch in kustomization.get("patches", []):
        docs = _patch(path, patch, docs)
    return docs


def _load(path: Path) -> list[Doc]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise KustomizeError(f"{path}: not a Kubernetes object: {doc!r:.80}")
    return docs


def _id(doc: Doc) -> tuple[str, str, str]:
    return doc["apiVersion"], doc["kind"], doc["metadata"]["name"]


def _selects(target: dict[str, str], doc: Doc) -> bool:
    """kustomize's selector: every field given is an anchored regular expression."""
    group, _, version = doc["apiVersion"].rpartition("/")
    fields = {"group": group, "version": version, "kind": doc["kind"],
              "name": doc["metadata"]["name"]}
    return all(re.fullmatch(pattern, fields[key]) for key, pattern in target.items())


def _patch(path: Path, patch: dict[str, Any], docs: list[Doc]) -> list[Doc]:
    if set(patch) != {"target", "patch"}:
        raise KustomizeError(f"{path}: a patch needs exactly `target` and an inline `patch`, "
                             f"got {sorted(patch)}")
    target = patch["target"]
    if unknown := set(target) - TARGET_FIELDS:
        raise KustomizeError(f"{path}: unsupported target fields {sorted(unknown)}")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise KustomizeError(f"{path}: patch for {target} is not a JSON6902 list of operations")
    selected = [i for i, doc in enumerate(docs) if _selects(target, doc)]
    if not selected:
        raise KustomizeError(f"{path}: patch target {target} selects no resource")
    patched = list(docs)
    for i in selected:
        try:
            patched[i] = jsonpatch.apply_patch(docs[i], ops)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
            raise KustomizeError(f"{path}: patch for {'/'.join(_id(docs[i]))}: {e}") from e
    return patched
