"""Packed rows: k consecutive rows of the update in one row, their common opening once.

A group's episodes start with the same opening (the system prompt and the task's first
observation: ~500 tokens of the SmolLM2 BabyAI rows, whose episodes average ~1,000), and a
batch's rows are padded to its longest episode. `pack_rows` lays each block of k consecutive
rows (a group, when k is the group size) out as one row: the block's longest common prefix,
then each row's own continuation after it, back to back, then padding. The model runs on the
packed rows (`decoder.Segments`: a continuation sees the shared prefix and itself, at the
positions it has in its own row) and every per-token result is gathered back to the rows
(`index`), so the losses, estimators and metrics read the same [R, L] arrays as without
packing; the gather's transpose sums a shared token's gradients over the rows that share it.

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
  starts [G, Lp] int32: the packed index of the first token of the token's segment (0 in the
    shared prefix; a padded position's own index, so that no query block of padding visits
    the keys of the rows before it).
  shared [G] int32: the length of each packed row's shared prefix.
  index [R, L] int32: where token t of row r sits in its block's packed row (0 past the row's
    valid tokens).
  """

  tokens: np.ndarray
  valid: np.ndarray
  positions: np.ndarray
  starts: np.ndarray
  shared: np.ndarray
  index: np.ndarray


def common_prefix(rows: list[np.ndarray]) -> int:
  """The length of the longest common prefix of 1-D token arrays."""
  n = min(len(r) for r in rows)
  same = np.ones(n, bool)
  for r in rows[1:]:
    same &= rows[0][:n] == r[:n]
  return int(n if same.all() else np.argmin(same))


def pack_rows(tokens: np.ndarray, valid: np.ndarray, rows_per_pack: int, pad_id: int,
              minimum: int = 64) -> PackedRows:
  """Packs each block of `rows_per_pack` consecutive rows of right-padded `tokens` [R, L]
  (`valid` [R, L]) into one row: the block's common prefix, then each row's tokens after it.

  Lp = `bucket_length` of the longest packed row (at least `minimum`), so a run sees few
  shapes. Raises ValueError when R is not a multiple of `rows_per_pack` or a row's valid
  tokens are not a prefix of it.
  """
  tokens, valid = np.asarray(tokens), np.asarray(valid, bool)
  rows, length = tokens.shape
  if rows_per_pack < 1 or rows % rows_per_pack:
    raise ValueError(f"pack_rows: {rows} rows do not split into blocks of {rows_per_pack}; "
                     "make the batch's rows a multiple of algo.pack_rows.")
  lengths = valid.sum(axis=1)
  if not np.array_equal(valid, np.arange(length)[None] < lengths[:, None]):
    raise ValueError("pack_rows: rows must be right-padded (valid tokens first).")
  blocks = []
  for first in range(0, rows, rows_per_pack):
    own = [tokens[r, :lengths[r]] for r in range(first, first + rows_per_pack)]
    blocks.append((first, own, common_prefix(own)))
  packed_length = bucket_length(
      max(p + sum(len(r) - p for r in own) for _, own, p in blocks), minimum)
  out = PackedRows(
      tokens=np.full((len(blocks), packed_length), pad_id, np.int32),
      valid=np.zeros((len(blocks), packed_length), bool),
      positions=np.zeros((len(blocks), packed_length), np.int32),
      starts=np.zeros((len(blocks), packed_length), np.int32),
      shared=np.array([p for _, _, p in blocks], np.int32),
      index=np.zeros((rows, length), np.int32))
  for g, (first, own, shared) in enumerate(blocks):
    out.tokens[g, :shared] = own[0][:shared]
    out.positions[g, :shared] = np.arange(shared)
    end = shared
    for i, row in enumerate(own):
      start, end = end, end + len(row) - shared
      out.tokens[g, start:end] = row[shared:]
      out.positions[g, start:end] = np.arange(shared, len(row))
      out.starts[g, start:end] = start
      out.index[first + i, :len(row)] = np.concatenate(
          [np.arange(shared), np.arange(start, end)])
    out.valid[g, :end] = True
    out.starts[g, end:] = np.arange(end, packed_length)  # padding: a segment of its own each
  return out
