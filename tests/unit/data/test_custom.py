"""lockstep.data.custom: the data factory gets the settings it names; bad factories and bad batches stop first."""

from __future__ import annotations

import itertools
import logging
import sys
import textwrap

import pytest

from lockstep.config import Config, load_config
from lockstep.data.batch import collate_samples
from lockstep.data.custom import build_custom_datasets
from lockstep.errors import ConfigError, DataError
from lockstep.models.custom import build_custom_model

_ids = itertools.count()


@pytest.fixture
def factory(tmp_path, monkeypatch):
    """factory(source, name) -> a Config whose data.factory is `name` in a fresh module holding `source`."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = []

    def make(source: str, name: str = "build", **data) -> Config:
        module = f"lockstep_user_data_{next(_ids)}"
        (tmp_path / f"{module}.py").write_text(
            "import torch\nfrom dataclasses import dataclass\n" + textwrap.dedent(source)
        )
        modules.append(module)
        overrides = {
            "model.kind": "custom",
            "model.factory": "x:y",
            "data.kind": "custom",
            "data.factory": f"{module}:{name}",
            **{f"data.{k}": v for k, v in data.items()},
        }
        return load_config(None, overrides)

    yield make
    for module in modules:
        sys.modules.pop(module, None)


ECHO = """
    SEEN = []

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n): self.n = n
        def __len__(self): return self.n
        def __getitem__(self, i): return torch.tensor([float(i)])

    def build(path, max_files, eval_fraction, seed):
        SEEN.append(dict(path=path, max_files=max_files, eval_fraction=eval_fraction, seed=seed))
        return Rows(10), Rows(2)

    def build_kwargs(**settings):
        SEEN.append(settings)
        return Rows(4)

    def build_split(path, split):
        SEEN.append(split)
        return Rows(8 if split == "train" else 0)

    def build_bare():
        return Rows(4)
"""


def build(cfg, log=None):
    """data.factory's datasets, as the workload asks for them."""
    return build_custom_datasets(cfg.data, cfg.train.seed, collate_samples, log, cfg.set_keys)


def _seen(cfg: Config) -> list:
    return sys.modules[cfg.data.factory.split(":")[0]].SEEN


def test_the_factory_gets_the_resolved_settings_it_names(factory, tmp_path):
    cfg = factory(ECHO, path=str(tmp_path / "part-0.jsonl"), max_files=3, eval_fraction=0.25)
    train, eval_ds = build(cfg)
    assert (len(train), len(eval_ds)) == (10, 2)
    assert _seen(cfg) == [
        {
            "path": str(tmp_path / "part-0.jsonl"),
            "max_files": 3,
            "eval_fraction": 0.25,
            "seed": cfg.train.seed,
        }
    ]
    cfg = factory(ECHO, "build_kwargs", path="p")  # **kwargs takes all of them
    build(cfg)
    assert _seen(cfg) == [{"path": "p", "max_files": None, "eval_fraction": 0.02, "seed": 1337}]
    # a `split` parameter: one call per split; an empty eval is none
    cfg = factory(ECHO, "build_split", path="p")
    train, eval_ds = build(cfg)
    assert _seen(cfg) == ["train", "eval"] and len(train) == 8 and eval_ds is None


@pytest.mark.parametrize("key, value", [("path", "/data/part-1.jsonl"), ("max_files", 2)])
def test_a_setting_the_factory_would_ignore_is_an_error(factory, key, value):
    cfg = factory(ECHO, "build_bare", **{key: value})
    with pytest.raises(ConfigError) as info:
        build(cfg)
    assert str(info.value).startswith(f"data.{key} = {value!r} is set, but data.factory ")
    assert f"takes no {key!r} parameter, so it would be ignored" in str(info.value)
    assert f"add `{key}` to its parameters" in str(info.value)


def test_eval_fraction_the_factory_ignores_is_a_warning(factory, caplog):
    cfg = factory(ECHO, "build_bare", eval_fraction=0.3)
    with caplog.at_level(logging.WARNING):
        build(cfg, logging.getLogger("t"))
    assert "data.eval_fraction = 0.3 has no effect: data.factory" in caplog.text
    caplog.clear()
    build(factory(ECHO, "build_bare"), logging.getLogger("t"))  # default: silent
    assert not caplog.text


BAD = """
    class Rows(torch.utils.data.Dataset):
        def __len__(self): return 3
        def __getitem__(self, i): return torch.zeros(2)

    class Broken(Rows):
        def __getitem__(self, i): raise KeyError(f"row {i}")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self): yield torch.zeros(2)

    class Empty(Rows):
        def __len__(self): return 0

    def needs_more(path, tokenizer): return Rows()
    def raises(): raise ValueError("cannot open the corpus")
    def stream(): return Stream()
    def number(): return 3
    def triple(): return Rows(), Rows(), Rows()
    def empty(): return Empty()
    def broken(): return Broken()
"""


@pytest.mark.parametrize(
    "name, error, message",
    [
        (
            "needs_more",
            ConfigError,
            "has a parameter 'tokenizer' without a default, which lockstep cannot fill: it "
            "passes path, max_files, eval_fraction, seed, split by name",
        ),
        ("raises", ConfigError, "raised ValueError: cannot open the corpus (at "),
        (
            "stream",
            ConfigError,
            "returned a Stream as the train set (an IterableDataset cannot be resumed exactly); "
            "return a map-style Dataset",
        ),
        ("number", ConfigError, "returned a int as the train set"),
        ("triple", ConfigError, "returned a tuple of 3; return a Dataset, or a (train, eval) pair"),
        ("empty", DataError, "returned an empty train set (len 0)"),
        ("broken", DataError, "raised KeyError: 'row 0' reading sample 0 (at "),
    ],
)
def test_a_bad_factory_stops_before_training_with_the_rule_and_the_fix(
    factory, name, error, message
):
    with pytest.raises(error) as info:
        build(factory(BAD, name))
    assert message in str(info.value), str(info.value)
    assert f":{name}'" in str(info.value)  # names the factory


def test_a_model_factory_that_raises_names_itself_and_the_line(factory, tmp_path):
    module = "lockstep_user_model_raises"
    (tmp_path / f"{module}.py").write_text(
        "def build():\n    raise RuntimeError('no weights here')\n"
    )
    cfg = factory(ECHO)
    cfg.model.factory = f"{module}:build"
    with pytest.raises(
        ConfigError,
        match=rf"model.factory '{module}:build' raised RuntimeError: no weights here "
        rf"\(at .*{module}.py:2\); fix the error in the factory",
    ):
        build_custom_model(cfg.model)
    sys.modules.pop(module, None)


def test_a_field_that_cannot_go_to_the_device_is_named(factory):
    source = """
    class Style: pass

    @dataclass
    class Cond:
        speaker: torch.Tensor
        style: object

    class Rows(torch.utils.data.Dataset):
        def __len__(self): return 4
        def __getitem__(self, i): return {"tokens": torch.zeros(2), "cond": Cond(torch.tensor(i), Style())}

    def build(): return Rows()
    """
    with pytest.raises(DataError, match=r"sample\['cond'\]\.style cannot be batched: .*Style"):
        build(factory(source))
