"""Your own data: `data.factory` called with the settings it asks for, and its batches checked before training.

The factory is called with the keyword arguments its signature names, out of these (anything else
needs a default):

    path           data.path (str or None): a file, folder or glob; `--data` sets it
    max_files      data.max_files (int or None): use only the first N files
    eval_fraction  data.eval_fraction (float): the share to hold out for evaluation
    seed           train.seed (int): for any shuffling or splitting the factory does
    split          "train" or "eval": when named, the factory is called once per split and returns one
                   Dataset (None for no eval set); otherwise it returns a Dataset or a (train, eval) pair
                   (a **kwargs parameter takes the others, not split)

        def build_data(path, eval_fraction, seed): ...          # data.factory: my_data:build_data

A setting that would be silently ignored is an error (data.path or data.max_files set for a factory
without that parameter) or a warning (data.eval_fraction). Datasets are map-style: lockstep's sampler
picks indices, which is what makes resume exact.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection
from typing import Any

from torch.utils.data import Dataset

from lockstep.config import Config, DataConfig
from lockstep.data.batch import check_movable, collate_samples
from lockstep.errors import ConfigError, DataError
from lockstep.user_code import import_object

FACTORY_SETTINGS = ("path", "max_files", "eval_fraction", "seed", "split")


def build_custom_datasets(
    d: DataConfig,
    seed: int,
    collate: Callable[[list[Any]], Any],
    log: logging.Logger | None = None,
    set_keys: Collection[str] = (),
) -> tuple[Dataset, Dataset | None]:
    """(train, eval or None) from data.factory; the first batch is built and checked here, before training.

    `seed` is train.seed; `set_keys` the config keys the user set (a setting the factory ignores is warned about
    only when the user set it)."""
    from lockstep.user_code import import_object, where_raised

    spec = d.factory
    factory = import_object(spec, "data.factory")
    takes = _settings_taken(factory, spec)
    values = {
        "path": d.path,
        "max_files": d.max_files,
        "eval_fraction": d.eval_fraction,
        "seed": seed,
    }
    for key in ("path", "max_files"):
        if values[key] is not None and key not in takes:
            raise ConfigError(
                f"data.{key} = {values[key]!r} is set, but data.factory {spec!r} takes no {key!r} parameter, so it "
                f"would be ignored and the run would train on whatever the factory builds; add `{key}` to its "
                f"parameters (it is passed by name), or drop data.{key}"
            )
    if "data.eval_fraction" in set_keys and "eval_fraction" not in takes and log is not None:
        log.warning(
            "data.eval_fraction = %s has no effect: data.factory %r takes no 'eval_fraction' parameter (the "
            "factory decides the eval set); add the parameter, or drop the setting",
            d.eval_fraction,
            spec,
        )
    kwargs = {k: v for k, v in values.items() if k in takes}

    def call(**extra: Any) -> Any:
        try:
            return factory(**kwargs, **extra)
        except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
            raise ConfigError(
                f"data.factory {spec!r} raised {type(e).__name__}: {e} (at {where_raised(e)}); "
                "fix the error in the factory"
            ) from e

    if "split" in takes:
        train_ds, eval_ds = call(split="train"), call(split="eval")
    else:
        made = call()
        if isinstance(made, tuple) and len(made) != 2:
            raise ConfigError(
                f"data.factory {spec!r} returned a tuple of {len(made)}; return a Dataset, or a "
                "(train, eval) pair of them"
            )
        train_ds, eval_ds = made if isinstance(made, tuple) else (made, None)
    for name, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is None and name == "eval":
            continue
        if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            iterable = (
                " (an IterableDataset cannot be resumed exactly)" if hasattr(ds, "__iter__") else ""
            )
            raise ConfigError(
                f"data.factory {spec!r} returned a {type(ds).__name__} as the {name} set{iterable}; "
                "return a map-style Dataset (with __len__ and __getitem__), or a (train, eval) pair"
            )
        if len(ds) == 0 and name == "train":
            raise DataError(
                f"data.factory {spec!r} returned an empty train set (len 0)"
                + (f" for data.path = {d.path!r}" if d.path else "")
                + "; check the data it reads"
            )
    check_first_batch(train_ds, collate, spec)
    return train_ds, eval_ds if eval_ds is not None and len(eval_ds) else None


def _settings_taken(factory: Callable, spec: str) -> set[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: call it bare
        return set()
    takes = set()
    for p in params:
        # **kwargs: every setting; per-split calls only when `split` is named
        if p.kind is p.VAR_KEYWORD:
            takes.update(name for name in FACTORY_SETTINGS if name != "split")
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.name in FACTORY_SETTINGS and p.kind is not p.POSITIONAL_ONLY:
            takes.add(p.name)
        elif p.default is p.empty:
            raise ConfigError(
                f"data.factory {spec!r} has a parameter {p.name!r} without a default, which lockstep "
                f"cannot fill: it passes {', '.join(FACTORY_SETTINGS)} by name; rename it to one of "
                "those or give it a default"
            )
    return takes


def check_first_batch(ds: Dataset, collate: Callable[[list[Any]], Any], spec: str) -> None:
    """Read two samples, collate them and check every leaf can go to the device: bad data stops here, not at step N."""
    from lockstep.user_code import where_raised

    samples = []
    for i in range(min(2, len(ds))):
        try:
            samples.append(ds[i])
        except Exception as e:  # noqa: BLE001
            raise DataError(
                f"the dataset from data.factory {spec!r} raised {type(e).__name__}: {e} reading sample {i} "
                f"(at {where_raised(e)}); fix its __getitem__"
            ) from e
    try:
        batch = collate(samples)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001
        raise DataError(
            f"collating the first samples of data.factory {spec!r} failed: {type(e).__name__}: {e}; "
            "return tensors, numbers, strings or dataclasses / dicts / tuples of them from __getitem__, "
            "or pass data.collate"
        ) from e
    check_movable(batch)


def custom_data(
    cfg: Config, log: logging.Logger | None
) -> tuple[Dataset, Dataset | None, Callable]:
    """data.kind custom: (train, eval or None, collate): your factory's datasets and data.collate, or torch's
    default collate."""

    collate = (
        import_object(cfg.data.collate, "data.collate") if cfg.data.collate else collate_samples
    )
    train_ds, eval_ds = build_custom_datasets(cfg.data, cfg.train.seed, collate, log, cfg.set_keys)
    return train_ds, eval_ds, collate
