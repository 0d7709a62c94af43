"""lockstep.models.custom: importing a factory, moving batches, calling the model, finding the loss."""

from __future__ import annotations

import itertools
import sys
import textwrap
from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lockstep.errors import ConfigError
from lockstep.config import ModelConfig
from lockstep.models.custom import build_custom_loss, build_custom_model, call_model, extract_loss
from lockstep.user_code import import_object
from lockstep.data.batch import move_to_device

_ids = itertools.count()


@pytest.fixture
def write_module(tmp_path, monkeypatch):
    """write_module(source) -> a fresh, importable module name (dropped from sys.modules afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(source: str) -> str:
        name = f"lockstep_user_mod_{next(_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


USER_MODULE = """
    import torch
    from torch import nn

    VALUE = 3

    def build_model():
        return nn.Linear(4, 2)

    def build_pair():
        return nn.Linear(4, 2), None

    def my_loss(output, batch):
        return output.float().pow(2).mean()

    class Net(nn.Module):
        pass
"""


def test_import_object_good(write_module):
    mod = write_module(USER_MODULE)
    assert isinstance(import_object(f"{mod}:build_model", "model.factory")(), nn.Linear)
    assert import_object(f"{mod}:Net", "model.factory").__name__ == "Net"


@pytest.mark.parametrize("spec", ["mypackage.models.build_model", "a:b:c", ":build", "mod:"])
def test_import_object_needs_one_colon(spec):
    with pytest.raises(ConfigError, match=r"model\.factory = .* must be 'package\.module:function' with exactly "
                                          r"one colon, e\.g\. 'mypackage\.models:build_model'"):
        import_object(spec, "model.factory")


def test_import_object_missing_module():
    with pytest.raises(ConfigError) as info:
        import_object("no_such_pkg_xyz.models:build", "model.factory")
    msg = str(info.value)
    assert "module 'no_such_pkg_xyz.models' could not be imported" in msg
    assert "ModuleNotFoundError: No module named 'no_such_pkg_xyz'" in msg
    assert "PYTHONPATH" in msg and "pip install -e" in msg and "on sys.path" in msg


def test_import_object_module_with_missing_dependency(write_module):
    mod = write_module("import not_installed_dep_xyz\n")
    with pytest.raises(ConfigError, match=rf"module '{mod}' imports 'not_installed_dep_xyz', which is not "
                                          r"installed \(ModuleNotFoundError: No module named"):
        import_object(f"{mod}:build", "model.factory")


def test_import_object_missing_attribute_lists_callables(write_module):
    mod = write_module(USER_MODULE)
    with pytest.raises(ConfigError) as info:
        import_object(f"{mod}:bulid_model", "model.factory")
    msg = str(info.value)
    assert f"module '{mod}'" in msg and "has no attribute 'bulid_model'" in msg
    assert "did you mean 'build_model'?" in msg
    # the module's own callables come first, imported ones (torch's) after
    assert "callables it has: Net, build_model, build_pair, my_loss" in msg
    assert "VALUE" not in msg


def test_import_object_module_raises_on_import(write_module, tmp_path):
    mod = write_module("""
        SETTING = 1
        RATIO = SETTING / 0
    """)
    with pytest.raises(ConfigError) as info:
        import_object(f"{mod}:build", "data.factory")
    msg = str(info.value)
    assert msg.startswith(f"data.factory = '{mod}:build': importing module '{mod}' raised ZeroDivisionError: "
                          "division by zero")
    assert f"{tmp_path / mod}.py:3" in msg
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_import_object_not_callable(write_module):
    mod = write_module(USER_MODULE)
    with pytest.raises(ConfigError, match="names an object of type int, which is not callable"):
        import_object(f"{mod}:VALUE", "model.loss")


def test_build_custom_model_and_loss(write_module):
    mod = write_module(USER_MODULE)
    cfg = ModelConfig(kind="custom", factory=f"{mod}:build_model", loss=f"{mod}:my_loss")
    assert isinstance(build_custom_model(cfg), nn.Linear)
    assert build_custom_loss(cfg)(torch.ones(3), None).item() == 1.0
    assert build_custom_loss(ModelConfig(kind="custom", factory=f"{mod}:build_model")) is None
    with pytest.raises(ConfigError, match=r"returned a tuple of 2 \(a Linear, a NoneType\), not a torch\.nn\."
                                          r"Module; make it return the model itself"):
        build_custom_model(ModelConfig(kind="custom", factory=f"{mod}:build_pair"))


Pair = namedtuple("Pair", ["features", "name"])


@dataclass
class Batch:
    x: torch.Tensor
    extras: list
    tag: str = "train"
    size: int = field(init=False, default=0)

    def __post_init__(self):
        self.size = len(self.x)


@dataclass(frozen=True)
class Frozen:
    y: torch.Tensor


def test_move_to_device_keeps_containers_and_moves_tensors():
    t = torch.arange(6.0).view(2, 3)
    name = "utt-1"
    nested = {
        "dict": OrderedDict(a=t, b=defaultdict(list, c=t)),
        "tuple": (t, 3, name),
        "named": Pair(features=t, name=name),
        "dc": Batch(x=t, extras=[t, (t,)], tag="eval"),
        "frozen": Frozen(t),
        "list": [t, None],
    }
    moved = move_to_device(nested, "meta")  # the meta device shows the move without a GPU
    assert type(moved) is dict and moved is not nested
    assert type(moved["dict"]) is OrderedDict and type(moved["dict"]["b"]) is defaultdict
    assert moved["dict"]["b"].default_factory is list
    assert type(moved["tuple"]) is tuple and moved["tuple"][1:] == (3, name) and moved["tuple"][2] is name
    assert type(moved["named"]) is Pair and moved["named"].name is name
    assert type(moved["dc"]) is Batch and moved["dc"].tag == "eval" and moved["dc"].size == 2
    assert type(moved["dc"].extras) is list and type(moved["dc"].extras[1]) is tuple
    assert type(moved["frozen"]) is Frozen and moved["list"][1] is None
    tensors = [moved["dict"]["a"], moved["dict"]["b"]["c"], moved["tuple"][0], moved["named"].features,
               moved["dc"].x, moved["dc"].extras[0], moved["dc"].extras[1][0], moved["frozen"].y, moved["list"][0]]
    assert all(x.is_meta and x.shape == (2, 3) for x in tensors)
    # the input batch is untouched
    assert nested["dc"].x is t and nested["named"].features is t and not t.is_meta


def test_move_to_device_leaves():
    assert move_to_device(torch.ones(2), "meta").is_meta
    assert move_to_device("text", "meta") == "text"
    assert move_to_device(None, "meta") is None


class Recorder(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


def test_call_model_variants():
    model, t = Recorder(), torch.ones(2)
    assert call_model(model, {"input_ids": t, "labels": t}) == ((), {"input_ids": t, "labels": t})
    assert call_model(model, (t, 1)) == ((t, 1), {})
    assert call_model(model, [t, 1]) == ((t, 1), {})
    pair = Pair(t, "a")
    args, kwargs = call_model(model, pair)
    assert len(args) == 1 and args[0] is pair and not kwargs
    dc = Batch(x=t, extras=[])
    assert call_model(model, dc)[0][0] is dc
    assert call_model(model, t)[0][0] is t


def test_extract_loss_variants():
    scalar = torch.tensor(2.5)
    assert extract_loss(scalar, None) is scalar
    assert extract_loss(SimpleNamespace(loss=scalar, logits=torch.ones(3)), None) is scalar
    assert extract_loss({"loss": scalar, "logits": torch.ones(3)}, None) is scalar

    @dataclass
    class Out:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    assert extract_loss(Out(torch.ones(3), scalar), None) is scalar
    batch = {"y": torch.tensor([1.0, 3.0])}
    loss = extract_loss(torch.zeros(2), batch, loss_fn=lambda out, b: (out - b["y"]).pow(2).mean())
    assert loss.item() == 5.0


def test_extract_loss_errors():
    logits, loss = torch.ones(2, 3), torch.tensor(1.0)
    with pytest.raises(ConfigError, match=r"model's output, a tuple of 2 \(a Tensor of shape \(2, 3\), a Tensor "
                                          r"of shape \(\)\); return a scalar tensor.*model\.loss = 'module:function'"):
        extract_loss((logits, loss), None)
    with pytest.raises(ConfigError, match=r"a dict with keys \['logits'\]"):
        extract_loss({"logits": logits}, None)
    with pytest.raises(ConfigError, match=r"a Tensor of shape \(2, 3\); return a scalar"):
        extract_loss(logits, None)

    @dataclass
    class Out:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    with pytest.raises(ConfigError, match=r"an? Out with fields \['logits', 'loss'\] \(its loss is None: .*'labels'"):
        extract_loss(Out(logits), None)
    with pytest.raises(ConfigError, match=r"the loss from model\.loss has shape \(2, 3\), not a scalar.*\.mean\(\)"):
        extract_loss(logits, None, loss_fn=lambda out, batch: out)
    with pytest.raises(ConfigError, match=r"the loss from output\.loss has shape \(4,\)"):
        extract_loss(SimpleNamespace(loss=torch.ones(4)), None)
    with pytest.raises(ConfigError, match=r"the loss from model\.loss is a float, not a tensor"):
        extract_loss(logits, None, loss_fn=lambda out, batch: 0.5)
