"""Packed rows: several rows of the update in one row, each group's common opening once.

A group's episodes start with the same opening (the system prompt and the task's first
observation: ~500 tokens of the SmolLM2 BabyAI rows, whose episodes average ~1,000), and a
batch's rows are padded to its longest episode. `pack_rows` lays each block of k consecutive
rows out as one row: for each group of g consecutive rows in it (g divides k), the group's
longest common prefix once, then each row's own continuation after it, back to back; then
padding. The model runs on the packed rows (`attention.Segments`: a continuation sees itself
and its group's opening, at the positions it has in its own row) and every per-token result is
gathered back to the rows (`index`), so the losses, estimators and metrics read the same
[R, L] arrays as without packing; the gather's transpose sums a shared token's gradients over
the rows that share it.

Host-side numpy, built with the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from agentgym_jax.rollout.trajectory import bucket_length


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """Blocks of k rows [R, L] packed into G = R / k rows of length Lp.

  tokens [G, Lp] int32, valid [G, Lp] bool: the packed rows (right-padded).
  positions [G, Lp] int32: each token's position in its own row (RoPE).
  starts [G, Lp] int32: the packed index of the first token of the token's segment (an
    opening is a segment of its own; a padded position's own index, so that no query block of
    padding visits the keys of the rows before it).
  shared_start, shared_end [G, Lp] int32: the opening a continuation continues, [start, end)
    in the packed row (equal, at the token's own segment start: none).
  index [R, L] int32: where token t of row r sits in its block's packed row (0 past the row's
    valid tokens).
  """

  tokens: np.ndarray
  valid: np.ndarray
  positions: np.ndarray
  starts: np.ndarray
  shared_start: np.ndarray
  shared_end: np.ndarray
  index: np.ndarray


def common_prefix(rows: list[np.ndarray]) -> int:
  """The length of the longest common prefix of 1-D token arrays."""
  n = min(len(r) for r in rows)
  same = np.ones(n, bool)
  for r in rows[1:]:
    same &= rows[0][:n] == r[:n]
  return int(n if same.all() else np.argmin(same))


def pack_rows(tokens: np.ndarray, valid: np.ndarray, rows_per_pack: int, rows_per_opening: int,
              pad_id: int, minimum: int = 64) -> PackedRows:
  """Packs each block of `rows_per_pack` consecutive rows of right-padded `tokens` [R, L]
  (`valid` [R, L]) into one row: per group of `rows_per_opening` consecutive rows, the
  group's common prefix, then each row's tokens after it.

  Lp = `bucket_length` of the longest packed row (at least `minimum`), so a run sees few
  shapes. Raises ValueError when R is not a multiple of `rows_per_pack`, `rows_per_pack` not
  one of `rows_per_opening`, or a row's valid tokens are not a prefix of it.
  """
  tokens, valid = np.asarray(tokens), np.asarray(valid, bool)
  rows, length = tokens.shape
  if rows_per_pack < 1 or rows % rows_per_pack:
    raise ValueError(f"pack_rows: {rows} rows do not split into blocks of {rows_per_pack}; "
                     "make the batch's rows a multiple of algo.pack_rows.")
  if rows_per_opening < 1 or rows_per_pack % rows_per_opening:
    raise ValueError(f"pack_rows: blocks of {rows_per_pack} rows do not split into groups of "
                     f"{rows_per_opening}; make algo.pack_rows a multiple of the group size.")
  lengths = valid.sum(axis=1)
  if not np.array_equal(valid, np.arange(length)[None] < lengths[:, None]):
    raise ValueError("pack_rows: rows must be right-padded (valid tokens first).")
  own = [tokens[r, :lengths[r]] for r in range(rows)]
  groups = [(first, common_prefix(own[first:first + rows_per_opening]))
            for first in range(0, rows, rows_per_opening)]
  per_pack = rows_per_pack // rows_per_opening
  sizes = [sum(p + sum(len(r) - p for r in own[first:first + rows_per_opening])
               for first, p in groups[i:i + per_pack]) for i in range(0, len(groups), per_pack)]
  packed_length = bucket_length(max(sizes), minimum)
  shape = (len(sizes), packed_length)
  out = PackedRows(
      tokens=np.full(shape, pad_id, np.int32), valid=np.zeros(shape, bool),
      positions=np.zeros(shape, np.int32),
      starts=np.broadcast_to(np.arange(packed_length, dtype=np.int32), shape).copy(),
      shared_start=np.broadcast_to(np.arange(packed_length, dtype=np.int32), shape).copy(),
      shared_end=np.broadcast_to(np.arange(packed_length, dtype=np.int32), shape).copy(),
      index=np.zeros((rows, length), np.int32))
  end = 0
  for n, (first, shared) in enumerate(groups):
    g = n // per_pack
    end = 0 if n % per_pack == 0 else end
    opening = slice(end, end + shared)  # a segment of its own, continuing nothing
    out.tokens[g, opening] = own[first][:shared]
    out.positions[g, opening] = np.arange(shared)
    out.starts[g, opening] = out.shared_start[g, opening] = out.shared_end[g, opening] = end
    end += shared
    for r in range(first, first + rows_per_opening):
      start, end = end, end + len(own[r]) - shared
      out.tokens[g, start:end] = own[r][shared:]
      out.positions[g, start:end] = np.arange(shared, len(own[r]))
      out.starts[g, start:end] = start
      out.shared_start[g, start:end], out.shared_end[g, start:end] = opening.start, opening.stop
      out.index[r, :len(own[r])] = np.concatenate(
          [np.arange(opening.start, opening.stop), np.arange(start, end)])
    out.valid[g, :end] = True
  return out
