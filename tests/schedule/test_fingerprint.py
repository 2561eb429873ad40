"""What the cache key depends on: the entry's local imports, the software of the machine."""

from __future__ import annotations

from pathlib import Path

from autofit.machine.device import get_hardware
from autofit.machine.fingerprint import MachineFingerprint, detect_machine
from autofit.workload.sources import import_root, local_sources


def _project(tmp_path: Path) -> Path:
    """model.py importing a sibling module, a package (its __init__ and a submodule), relatively too."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "blocks.py").write_text("from .norms import NORM\nWIDTH = 64\n")
    (tmp_path / "pkg" / "norms.py").write_text("NORM = 'layer'\n")
    (tmp_path / "layers.py").write_text("import torch\nDEPTH = 4\n")
    (tmp_path / "unused.py").write_text("X = 1\n")
    model = tmp_path / "model.py"
    model.write_text("import json\nimport layers\nfrom pkg import blocks\n\ndef workload():\n    return None\n")
    return model


def test_the_entry_key_covers_the_local_modules_it_imports_and_nothing_else(tmp_path: Path) -> None:
    model = _project(tmp_path)
    root, scope = import_root(f"{model}:workload", model)
    assert root == scope == tmp_path
    hashes = local_sources(model, root, scope)
    assert set(hashes) == {"model.py", "layers.py", "pkg/__init__.py", "pkg/blocks.py", "pkg/norms.py"}
    (tmp_path / "unused.py").write_text("X = 2\n")
    assert local_sources(model, root, scope) == hashes  # a file it does not import changes nothing
    (tmp_path / "pkg" / "norms.py").write_text("NORM = 'rms'\n")  # imported through blocks, relatively
    changed = local_sources(model, root, scope)
    assert changed["pkg/norms.py"] != hashes["pkg/norms.py"] and changed["model.py"] == hashes["model.py"]


def test_a_package_entry_counts_its_own_package_not_the_libraries_beside_it(tmp_path: Path) -> None:
    model = _project(tmp_path)
    root, scope = import_root("pkg.blocks:workload", tmp_path / "pkg" / "blocks.py")
    assert (root, scope) == (tmp_path, tmp_path / "pkg")
    assert set(local_sources(tmp_path / "pkg" / "blocks.py", root, scope)) == {"pkg/blocks.py", "pkg/norms.py"}
    assert model.exists()


def test_the_machine_key_covers_python_libraries_and_the_allocator_setting(monkeypatch) -> None:  # noqa: ANN001
    machine = detect_machine(get_hardware("cpu"))
    assert {"python", "transformers", "flash-attn", "triton", "autofit", "PYTORCH_CUDA_ALLOC_CONF"} <= set(machine.software)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert detect_machine(get_hardware("cpu")).key() != machine.key()
    newer = MachineFingerprint.from_dict(machine.to_dict() | {"software": machine.software | {"transformers": "99.0"}})
    assert newer.key() != machine.key()
    old_row = {k: v for k, v in machine.to_dict().items() if k != "software"}  # a row written before the field
    assert MachineFingerprint.from_dict(old_row).software == {}
