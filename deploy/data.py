"""Ray Data processor: every row of a ``ray.data.Dataset`` through the running runtime.

    import ray
    from deploy.data import ProcessorConfig, account, build_processor

    processor = build_processor(ProcessorConfig(concurrency=2, max_in_flight=32))
    out = processor(ray.data.read_parquet("/data/in/"))       # lazy, like any Dataset
    out.write_parquet("/data/out/")
    print(account(ray.data.read_parquet("/data/out/")).table())

Rows take ``ray.data.llm``'s fields: ``messages`` (chat) or ``prompt`` (text), and
``sampling_params`` (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ...,
and ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``,
``structural_tag``, ``json_object``, with an optional ``backend``); or the batch job's own
keys at the top level (``schema``, ``response_format``, ``regex``, ``choice``,
``max_tokens``, ...). A row is turned into a request by ``batch_input.parse_row`` and its
result into columns by ``batch_output.columns_of``: the JSONL batch job's own conversions.

Each output row is its input row plus ``generated_text``, ``num_generated_tokens``,
``num_input_tokens`` (ray.data.llm's), ``num_cached_tokens``, ``finish_reason``,
``outcome`` (``batch_account.OUTCOMES``), ``guided`` (``validation``,
``validation_error``, ``closed_early``, ``loop_cuts``, ``engine``, ``approximated``; null
without a grammar), ``grammar`` (its id), ``max_tokens``, ``error`` and ``error_kind``.
A bad row (no prompt, a bad schema, a worker error) is an error row, never a failed
pipeline; a transient failure (a worker died) is retried with the batch job's backoff.

Each actor of the pool (``concurrency`` of them) holds one ``RuntimeClient`` and keeps at
most ``max_in_flight`` requests in flight, over up to ``batches_per_actor`` batches at once
(the next batch's rows start while the last rows of one finish). Within a batch, rows are
sent grouped by how their prompt starts and by grammar, so rows of one instruction prompt
reach the runtime together: prefix-aware routing sends them to the worker that holds the
prefix, and each grammar is fetched once.

A schema given as an object through Arrow (Parquet, ``from_items``) gains, as null, every
key any other row's schema has; the processor drops null values from rows, so a schema
keyword whose value is JSON null (``"const": null``) must be given as JSON text.

The runtime must be running on the cluster (``rayguide up``); the pipeline runs as a Ray
job (``ray job submit --working-dir . -- python my_pipeline.py``) or any driver connected
to the cluster.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, Callable

import pyarrow as pa
from pydantic import Field

from core.config import ConfigModel
from core.grammar_spec import GrammarSpec
from core.prefix_keys import prefix_keys
from deploy import dialects
from deploy.batch_account import Account
from deploy.batch_input import Item, parse_row
from deploy.batch_job import run_item
from deploy.batch_output import COLUMNS, columns_of, error_row, row_of_columns

__all__ = ["ProcessorConfig", "Processor", "build_processor", "account", "OUTPUT_COLUMNS"]

OUTPUT_COLUMNS = tuple(COLUMNS)


class ProcessorConfig(ConfigModel):
    """How the processor sends rows (every field checked; unknown keys refused)."""

    concurrency: int = Field(1, ge=1)  # actors in the pool, each with one RuntimeClient
    max_in_flight: int = Field(32, ge=1)  # requests in flight per actor
    batch_size: int = Field(64, ge=1)  # rows per batch an actor takes
    batches_per_actor: int = Field(2, ge=1)  # batches one actor works on at once
    max_tokens: int = Field(256, ge=1)  # for rows that give none
    temperature: float = Field(0.0, ge=0.0)  # for rows that give none (0: greedy)
    json_schema: dict | str | None = None  # the format of rows that give none
    group_prefixes: bool = True  # send a batch's rows grouped by prompt start and grammar
    num_cpus: float = Field(0.25, ge=0.0)  # each actor's CPU reservation (it mostly waits)


def _arrow_type(spec) -> pa.DataType:
    if isinstance(spec, dict):
        return pa.struct([(name, _arrow_type(t)) for name, t in spec.items()])
    return {"string": pa.string(), "int64": pa.int64(), "bool": pa.bool_(),
            "list<string>": pa.list_(pa.string())}[spec]


OUTPUT_TYPES = {name: _arrow_type(spec) for name, spec in COLUMNS.items()}


def plain(value: Any) -> Any:
    """A row's value as the batch job reads it: numpy arrays and scalars as Python lists
    and numbers, and dict keys whose value is null dropped (Arrow's fill for keys another
    row has)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars
    if callable(tolist) and not isinstance(value, (str, bytes)):
        return plain(tolist())
    return value


def group_order(items: list[Item]) -> list[int]:
    """The order a batch's rows are sent in: grouped by the start of their prompt (its
    first prefix key, core/prefix_keys.py) and by grammar, first appearance first; rows
    without a request last."""
    first: dict[tuple, int] = {}

    def key(i: int) -> tuple:
        request = items[i].request
        if request is None:
            return (1, 0)
        keys = prefix_keys(request.prompt)
        group = (keys[0] if keys else _short_start(request.prompt), items[i].grammar or "")
        return (0, first.setdefault(group, len(first)))

    return sorted(range(len(items)), key=key)


def _short_start(prompt) -> str:
    """How a prompt shorter than one prefix chunk starts: its system message, else its
    text."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return str(prompt[0].get("content")) if prompt[0].get("role") == "system" else ""
    return str(prompt)


class RowSender:
    """One actor of the pool: a RuntimeClient, kept for the actor's life, and the in-flight
    cap shared by the batches it works on. ``__call__`` is a coroutine: Ray Data runs it on
    the actor's one event loop, several batches at once."""

    def __init__(self, config: dict):
        from cluster.client import RuntimeClient

        self.config = ProcessorConfig(**config)
        self.defaults = {"max_new_tokens": self.config.max_tokens,
                         "temperature": self.config.temperature}
        schema = self.config.json_schema
        self.default_grammar: GrammarSpec | None = (
            dialects.json_schema(schema, "json_schema") if schema is not None else None)
        self.tag = uuid.uuid4().hex[:8]
        self.batches = itertools.count()
        self.client = RuntimeClient()
        self.slots: asyncio.Semaphore | None = None  # made on the loop the batches run on

    async def __call__(self, batch: pa.Table) -> pa.Table:
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.config.max_in_flight)
        return with_columns(batch, await self.run(batch.to_pylist()))

    def item(self, row: Any, index: int, tag: str) -> Item:
        try:
            obj = plain(row)
            if not isinstance(obj, dict):
                return Item(index, index, error="the row is not a mapping of fields")
            return parse_row(obj, index, defaults=self.defaults,
                             default_grammar=self.default_grammar,
                             request_id=f"data-{tag}-{index}")
        except Exception as exc:  # noqa: BLE001 - a row no reader expected: its error row
            return Item(index, index, error=f"the row could not be read: {exc}")

    async def run(self, rows: list[dict]) -> list[dict]:
        """Each row's columns, in the rows' order."""
        tag = f"{self.tag}-{next(self.batches)}"
        items = [self.item(row, i, tag) for i, row in enumerate(rows)]
        order = group_order(items) if self.config.group_prefixes else range(len(items))
        results: list[dict | None] = [None] * len(items)

        async def one(i: int) -> None:
            async with self.slots:
                try:
                    row = await run_item(self.client, items[i])
                except Exception as exc:  # noqa: BLE001 - never a failed pipeline
                    row = error_row(items[i], f"{type(exc).__name__}: {exc}")
            results[i] = columns_of(row)

        # tasks start in the grouped order; the semaphore admits its waiters first in,
        # first out, so that is the order the rows reach the runtime in
        await asyncio.gather(*(one(i) for i in order))
        return results


def with_columns(batch: pa.Table, results: list[dict]) -> pa.Table:
    """The batch with the output columns (of their fixed Arrow types) set: one value per
    row, replacing an input column of the same name."""
    for name, kind in OUTPUT_TYPES.items():
        values = pa.array([r[name] for r in results], type=kind)
        if name in batch.column_names:
            batch = batch.drop_columns([name])
        batch = batch.append_column(pa.field(name, kind), values)
    return batch


class Processor:
    """What ``build_processor`` returns: ``processor(ds)`` is ``ds`` with every row sent
    through the runtime (lazy, as any Dataset transform)."""

    def __init__(self, config: ProcessorConfig,
                 preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None):
        self.config = config
        self.preprocess, self.postprocess = preprocess, postprocess

    def __call__(self, ds):
        from ray.data import ActorPoolStrategy

        _check_runtime()
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        c = self.config
        # blocks of one batch each (a streaming split, no shuffle): a large input block
        # would be one task, its batches on one actor
        ds = ds.repartition(target_num_rows_per_block=c.batch_size)
        ds = ds.map_batches(
            RowSender, fn_constructor_args=(c.model_dump(),), batch_format="pyarrow",
            batch_size=c.batch_size, num_cpus=c.num_cpus, udf_modifying_row_count=False,
            compute=ActorPoolStrategy(size=c.concurrency,
                                      max_concurrent_calls_per_actor=c.batches_per_actor,
                                      max_tasks_in_flight_per_actor=c.batches_per_actor))
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def _check_runtime() -> None:
    """Fails the pipeline's construction, not its first batch, when no runtime runs."""
    import ray

    from cluster import launch

    if not ray.is_initialized():
        ray.init()
    launch.handles()  # raises ValueError naming what is missing, and `rayguide up`


def build_processor(config: ProcessorConfig | dict | None = None, *,
                    preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Processor:
    """The processor to apply to a Dataset (``processor(ds)``), as ``ray.data.llm``'s
    ``build_llm_processor``: ``preprocess`` maps each input row to the fields above first,
    ``postprocess`` each output row after."""
    if config is None:
        config = ProcessorConfig()
    elif isinstance(config, dict):
        config = ProcessorConfig(**config)
    return Processor(config, preprocess, postprocess)


def account(ds) -> Account:
    """The batch job's account (outcomes, by grammar, prompt tokens cached) of a
    processor's output rows: ``print(account(out).table())``."""
    acc = Account()
    names = [n for n in OUTPUT_COLUMNS if n != "generated_text"]
    for cols in ds.select_columns(names).iter_rows():
        acc.add(row_of_columns(cols))
    return acc
