"""modules.py: a file is named the way its imports name it, through packages and namespace directories."""

from __future__ import annotations

from tpfuse.audit.driver import audit


def test_namespace_packages_are_named_apart(tmp_path):
    # sglang 0.5.10: srt/ and multimodal_gen/runtime/ lack __init__.py and both hold server_args.py.
    root = tmp_path / "eng"
    for sub in ("srt", "mm/runtime"):
        (root / sub).mkdir(parents=True)
        (root / sub / "server_args.py").write_text(
            "from eng.utils import is_sm100_supported\n\n\ndef pick():\n    if is_sm100_supported():\n        return "
            "'fast'\n    return 'slow'\n"
        )
    (root / "__init__.py").write_text("")
    (root / "mm" / "__init__.py").write_text("")
    (root / "utils.py").write_text("import torch\n\n\ndef is_sm100_supported():\n    return "
                                   "torch.cuda.get_device_capability()[0] == 10\n")
    tree = audit(str(root))
    gates = [f.path for f in tree.findings if f.category == "gate"]
    assert sorted(gates) == ["mm/runtime/server_args.py", "srt/server_args.py"] and not tree.skipped
    alone = audit(str(root / "srt" / "server_args.py"))
    assert [(f.id, f.enables) for f in alone.findings] == [(f.id, f.enables)
                                                           for f in tree.findings if f.path == "srt/server_args.py"]
