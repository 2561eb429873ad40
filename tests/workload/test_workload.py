"""The entry-point contract: loading, the one-line errors, and the Workload defaults."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from autofit import AutofitError, Workload
from autofit.workload.entry import load_workload
from autofit.workload.types import default_loss, longest_module_list

GOOD_ENTRY = """
import torch
from torch import nn
from autofit import Workload

def workload():
    return Workload(model=lambda: nn.Linear(3, 1), batch=lambda n: torch.randn(n, 3))

def named():
    return Workload(model=lambda: nn.Linear(3, 1), batch=lambda n: torch.randn(n, 3), name="my-name")
"""


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _assert_one_line(exc: pytest.ExceptionInfo[AutofitError], *fragments: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_load_from_file_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "entry_good.py", GOOD_ENTRY)
    workload = load_workload(f"{path}:workload")
    assert isinstance(workload, Workload)
    assert workload.name == "workload"  # defaults to the function's name
    assert isinstance(workload.build_model(), nn.Linear)
    assert workload.batch(5).shape == (5, 3)


def test_load_keeps_an_explicit_name(tmp_path: Path) -> None:
    path = _write(tmp_path, "entry_named.py", GOOD_ENTRY)
    assert load_workload(f"{path}:named").name == "my-name"


def test_load_from_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "afpkg_entry"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _write(package, "models.py", GOOD_ENTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    workload = load_workload("afpkg_entry.models:workload")
    assert isinstance(workload, Workload)
    assert workload.batch(2).shape == (2, 3)


def test_load_a_shipped_example_by_relative_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert load_workload("examples/mlp.py:workload").name == "residual-mlp"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AutofitError) as exc:
        load_workload(f"{tmp_path}/nope.py:workload")
    _assert_one_line(exc, "no such file", "nope.py")


def test_missing_module() -> None:
    with pytest.raises(AutofitError) as exc:
        load_workload("autofit_no_such_package.models:workload")
    _assert_one_line(exc, "cannot import", "autofit_no_such_package")


def test_missing_function(tmp_path: Path) -> None:
    path = _write(tmp_path, "entry_nofunc.py", GOOD_ENTRY)
    with pytest.raises(AutofitError) as exc:
        load_workload(f"{path}:missing")
    _assert_one_line(exc, "has no function", "'missing'")


def test_attribute_that_is_not_callable(tmp_path: Path) -> None:
    path = _write(tmp_path, "entry_notcallable.py", "workload = 3\n")
    with pytest.raises(AutofitError) as exc:
        load_workload(f"{path}:workload")
    _assert_one_line(exc, "not callable")


def test_module_that_fails_to_import(tmp_path: Path) -> None:
    path = _write(tmp_path, "entry_importfails.py", "raise RuntimeError('broken at import')\n")
    with pytest.raises(AutofitError) as exc:
        load_workload(f"{path}:workload")
    _assert_one_line(exc, "RuntimeError", "broken at import")


def test_entry_that_raises(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "entry_raises.py",
        """
        def workload():
            raise KeyError("no such model size")
        """,
    )
    with pytest.raises(AutofitError) as exc:
        load_workload(f"{path}:workload")
    _assert_one_line(exc, "raised KeyError", "no such model size")
    assert isinstance(exc.value.__cause__, KeyError)


def test_entry_returning_the_wrong_type(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "entry_wrongtype.py",
        """
        from torch import nn

        def workload():
            return nn.Linear(2, 2)
        """,
    )
    with pytest.raises(AutofitError) as exc:
        load_workload(f"{path}:workload")
    _assert_one_line(exc, "must return an autofit.Workload", "Linear")


def test_entry_building_an_invalid_workload(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "entry_invalid.py",
        """
        from autofit import Workload

        def workload():
            return Workload(model=lambda: None, batch=lambda n: None, tokens_per_sample=0)
        """,
    )
    with pytest.raises(AutofitError) as exc:
        load_workload(f"{path}:workload")
    _assert_one_line(exc, "tokens_per_sample", "0")


@pytest.mark.parametrize("entry", ["examples/gpt.py", "examples/gpt.py:", ":workload", "", "workload"])
def test_malformed_entry_string(entry: str) -> None:
    with pytest.raises(AutofitError) as exc:
        load_workload(entry)
    _assert_one_line(exc, "path/to/file.py:function")


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("model", {"model": "not callable"}),
        ("batch", {"batch": 3}),
        ("loss", {"loss": "mse"}),
        ("layers", {"layers": []}),
        ("tokens_per_sample", {"tokens_per_sample": -1}),
        ("tokens_per_sample", {"tokens_per_sample": 1.5}),
    ],
)
def test_workload_validation_names_the_field(field: str, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"model": lambda: nn.Linear(1, 1), "batch": lambda n: torch.zeros(n, 1)}
    args.update(kwargs)
    with pytest.raises(AutofitError, match=f"Workload.{field}"):
        Workload(**args)  # type: ignore[arg-type]


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _Recorder(nn.Module):
    """Records how it was called and returns what ``wrap`` makes of the sum of its inputs."""

    def __init__(self, wrap: Callable[[torch.Tensor], object] = lambda t: t) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[object, ...], dict[str, object]]] = []
        self.wrap = wrap

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> object:
        self.calls.append((args, kwargs))
        return self.wrap(sum(t.sum() for t in (*args, *kwargs.values())))


def test_default_loss_dict_batch_uses_kwargs_and_dot_loss() -> None:
    model = _Recorder(wrap=_Output)
    batch = {"a": torch.ones(2), "b": torch.full((2,), 2.0)}
    assert default_loss(model, batch).item() == 6.0
    args, kwargs = model.calls[0]
    assert args == () and set(kwargs) == {"a", "b"}


def test_default_loss_tuple_batch_uses_positional_args() -> None:
    model = _Recorder()
    batch = (torch.ones(3), torch.ones(3))
    assert default_loss(model, batch).item() == 6.0
    args, kwargs = model.calls[0]
    assert len(args) == 2 and kwargs == {}


def test_default_loss_tensor_batch_is_one_argument() -> None:
    model = _Recorder()
    assert default_loss(model, torch.ones(4)).item() == 4.0
    args, _ = model.calls[0]
    assert len(args) == 1


def test_default_loss_reads_a_loss_key_from_a_dict_output() -> None:
    model = _Recorder(wrap=lambda t: {"loss": t * 10, "logits": t})
    assert default_loss(model, torch.ones(2)).item() == 20.0


def test_default_loss_on_a_real_hf_style_output() -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import SequenceClassifierOutput

    model = _Recorder(wrap=lambda t: SequenceClassifierOutput(loss=t + 1, logits=t))
    assert default_loss(model, {"x": torch.ones(2)}).item() == 3.0


def test_custom_loss_overrides_the_default() -> None:
    workload = Workload(
        model=lambda: nn.Linear(2, 1),
        batch=lambda n: (torch.ones(n, 2), torch.zeros(n, 1)),
        loss=lambda model, batch: ((model(batch[0]) - batch[1]) ** 2).mean() * 0 + 42,
    )
    assert workload.compute_loss(workload.build_model(), workload.batch(3)).item() == 42


class _TwoLists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.short = nn.ModuleList(nn.Linear(1, 1) for _ in range(2))
        self.inner = nn.Sequential(nn.ModuleList(nn.ReLU() for _ in range(5)))
        self.tie = nn.ModuleList(nn.Tanh() for _ in range(5))


def test_longest_module_list_finds_the_longest_even_when_nested() -> None:
    layers = longest_module_list(_TwoLists())
    assert len(layers) == 5
    assert all(isinstance(layer, nn.ReLU) for layer in layers)  # first found wins a tie


def test_longest_module_list_empty_without_lists() -> None:
    assert longest_module_list(nn.Sequential(nn.Linear(1, 1), nn.ReLU())) == []


def test_repeated_layers_prefers_explicit_layers() -> None:
    model = _TwoLists()
    default = Workload(model=lambda: model, batch=lambda n: None)
    explicit = Workload(model=lambda: model, batch=lambda n: None, layers=lambda m: m.short)
    assert len(default.repeated_layers(model)) == 5
    assert explicit.repeated_layers(model) == list(model.short)


def test_searches_attention_only_with_an_attention_keyword() -> None:
    def with_attention(attention: str = "sdpa") -> nn.Module:
        return nn.Identity()

    def without_attention() -> nn.Module:
        return nn.Identity()

    seen: list[str] = []

    def recording(attention: str = "sdpa") -> nn.Module:
        seen.append(attention)
        return nn.Identity()

    assert Workload(model=with_attention, batch=lambda n: None).searches_attention
    assert not Workload(model=without_attention, batch=lambda n: None).searches_attention
    assert not Workload(model=nn.Identity, batch=lambda n: None).searches_attention  # a class: no `attention`
    # build_model passes attention only where it is accepted
    assert isinstance(Workload(model=without_attention, batch=lambda n: None).build_model("eager"), nn.Identity)
    Workload(model=recording, batch=lambda n: None).build_model("eager")
    assert seen == ["eager"]
