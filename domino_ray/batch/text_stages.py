"""The processor's CPU stages around the engine: prompts to token ids before it, token ids to text after.

Both are `map_batches` functions run as Ray tasks (a tokenizer cached per worker process), `pyarrow.Table`
in and out, one row out per row in (tokenize: one per sample of a row, `sampling_params.n`). Tasks rather
than actors: Ray fuses them with the light tasks next to them (the job's read before, its write after), so
they cost no processes of their own. Ray-free: the processor (processor.py) places them.

    tokenize_batch:   prompt | messages, sampling_params -> its n samples: sample_index, prompt (as the engine
                      sees it), prompt_token_ids, error
    detokenize_batch: generated_tokens, finish_reason    -> generated_text (cut at a stop string); then the error
                      policy and column order
"""

from __future__ import annotations

import functools

import pyarrow as pa

from domino_ray.batch.schema import (RowError, is_null, output_table, read_row, row_params, sample_count,
                                     with_columns)
from domino_ray.config import JobConfig, generation_defaults
from domino_ray.frontend.detokenizer import row_text

# The samples of a row still to generate (list<int32>), set by the job's resume (job._prepare); absent or null: all n.
SAMPLES_TO_DO = "__samples_to_do"


class RowFailed(RuntimeError):
    """A row failed and the processor was told to stop (`should_continue_on_error=False`)."""


@functools.lru_cache(maxsize=4)
def _tokenizer(source: str):
    """One tokenizer per worker process and source: Ray reuses task workers, so loading (and importing
    transformers, seconds) happens once per process, not per batch."""
    from domino_ray.target.loading import load_tokenizer

    return load_tokenizer(source)


def tokenize_batch(batch: pa.Table, cfg: JobConfig) -> pa.Table:
    """Chat template and tokenizer in one pass (the template's special tokens must stay apart from user
    text: target.encode_prompt), then each row as its samples (`sample_index`; those of SAMPLES_TO_DO when set).
    A row that cannot run keeps `prompt_token_ids` empty and says why in `error`; its sampling overrides are
    checked here too, so the engine stage only runs good rows."""
    tokenizer, base = _tokenizer(cfg.model.tokenizer or cfg.model.source), generation_defaults(cfg.generation)
    todo = (batch.column(SAMPLES_TO_DO).to_pylist() if SAMPLES_TO_DO in batch.column_names
            else [None] * batch.num_rows)
    rows, samples, prompts, ids, errors = [], [], [], [], []
    for i, row in enumerate(batch.to_pylist()):
        prompt, token_ids, error = _encode(row, cfg, tokenizer, base)
        indices = todo[i] if todo[i] is not None else range(sample_count(row.get(cfg.input.sampling_column), base))
        for index in indices:
            rows.append(i)
            samples.append(index)
            prompts.append(prompt)
            ids.append(token_ids)
            errors.append(error)
    if SAMPLES_TO_DO in batch.column_names:
        batch = batch.drop_columns([SAMPLES_TO_DO])
    return with_columns(batch.take(pa.array(rows, pa.int64())),
                        {"sample_index": samples, "prompt": prompts, "prompt_token_ids": ids, "error": errors})


def _encode(row: dict, cfg: JobConfig, tokenizer, base) -> tuple[str | None, list[int], str | None]:
    from domino_ray.target.loading import encode_prompt

    ic, m = cfg.input, cfg.model
    prompt = None
    try:
        if ic.id_column in row and is_null(row[ic.id_column]):
            raise RowError(f"{ic.id_column} is null (ids must be unique and non-null)")
        parsed = read_row(row, ic)
        prompt = parsed.prompt
        row_params(row.get(ic.sampling_column), base, cfg.generation.seed, row.get(ic.id_column))
        if parsed.messages is not None:
            ids = encode_prompt(tokenizer, messages=parsed.messages, enable_thinking=m.enable_thinking,
                                parse_special_tokens=m.parse_special_tokens)
            prompt = tokenizer.decode(ids)
        else:
            ids = encode_prompt(tokenizer, prompt=prompt, chat_template=m.chat_template,
                                enable_thinking=m.enable_thinking, parse_special_tokens=m.parse_special_tokens)
    except RowError as exc:
        return prompt, [], str(exc)
    except Exception as exc:  # tokenizer/template failures on odd input: the row fails, the job goes on
        return prompt, [], f"cannot encode the prompt: {type(exc).__name__}: {exc}"
    return prompt, ids, None


def detokenize_batch(batch: pa.Table, cfg: JobConfig, *, detokenize: bool = True, continue_on_error: bool = True,
                     error_column: str = "error", schema: pa.Schema | None = None) -> pa.Table:
    """Generated token ids to `generated_text` (a trailing stop token dropped, special tokens skipped), then
    what ends every batch: a failed row stops the run unless `continue_on_error`, the error column takes
    its name, and the columns their order (or the job's `schema`)."""
    if not continue_on_error:
        _stop_at_a_failed_row(batch, cfg.input.id_column)
    reasons = batch.column("finish_reason").to_pylist()
    texts = [""] * batch.num_rows
    if detokenize:
        tokenizer, base = _tokenizer(cfg.model.tokenizer or cfg.model.source), generation_defaults(cfg.generation)
        column = cfg.input.sampling_column
        overrides = batch.column(column).to_pylist() if column in batch.column_names else [None] * batch.num_rows
        for i, tokens in enumerate(batch.column("generated_tokens").to_pylist()):
            if reasons[i] != "error":  # its overrides are good (the tokenize stage checked them)
                texts[i] = row_text(tokenizer, tokens, row_params(overrides[i], base, None, None), reasons[i] == "stop")
    table = output_table(with_columns(batch, {"generated_text": texts}), schema)
    if error_column != "error":
        table = table.rename_columns([error_column if n == "error" else n for n in table.column_names])
    return table


def _stop_at_a_failed_row(batch: pa.Table, id_column: str):
    errors = batch.column("error").to_pylist()
    failed = next((i for i, e in enumerate(errors) if e is not None), None)
    if failed is None:
        return
    if id_column in batch.column_names:
        name = f"{id_column}={batch.column(id_column)[failed].as_py()!r}"
    else:
        prompt = batch.column("prompt")[failed].as_py()
        name = f"prompt={prompt[:80]!r}" if prompt is not None else "with a null prompt"
    raise RowFailed(f"row {name} failed: {errors[failed]} (should_continue_on_error=False; set it to true "
                    "to get error rows instead)")
