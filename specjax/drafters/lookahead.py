"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"): no draft model; a lookahead branch runs Jacobi iterations over a 2D window, the n-grams its
trajectories produce go into a pool, and a verification branch checks the pooled n-grams that start with the last
committed token -- both branches in ONE target forward per step.

Window W, n-gram size N, guess set size G (options window_size, ngram_size, guess_set_size; the reference
implementation's WINDOW_SIZE, LEVEL, GUESS_SET_SIZE). Each step verifies one token tree of
T = 1 + (W + G)(N - 1) nodes, so the options fix k = (W + G)(N - 1) (num_speculative_tokens: unset, or that):
  - node 0, the root: the last committed token;
  - the lookahead branch: levels j = 0 .. N-2 of W tokens each (level 0 oldest). Token (j, i) attends to the
    paper's set -- level-0 tokens 0 .. i-j, then the diagonal (1, i-j+1) .. (j, i) -- which is a path from the
    root: parent(j, i) = (j-1, i-1) for j > 0, (0, i-1) for j = 0, the root for i = 0; depth i + 1 (its position
    offset). So the paper's combined attention mask is a tree mask and the existing tree verification runs it;
  - the verification branch: G chains of N - 1 tokens, the pooled continuations of the root token.
The target's argmax after each lookahead node is the Jacobi update: the output after (N-2, i) is the new guess
for window position i + 1 (after the root, for position 0); the oldest level is dropped and the new one appended.
Each diagonal of the old window plus that output is an n-gram: (0, i-N+2), (1, i-N+3), ..., (N-2, i), output,
collected into the pool for i = N-2 .. W-1 (W - N + 2 n-grams a step).

The n-gram pool: fixed-capacity arrays keyed by the first token, pool [B, V, G, N-1] (-1 = empty) with a FIFO
write pointer per key [B, V]; an n-gram already in its key's slots is not inserted again.

What differs from the paper (documented choices; none affects exactness):
  - the pool is also seeded with the prompt's n-grams and fed the committed text's n-grams after every step
    (the reference implementation's pool-from-prompt, extended to the output), besides the trajectories;
  - the window keeps its slots when tokens are committed (no re-alignment), and it starts from prompt tokens;
  - lookahead nodes are ordinary tree nodes, so a lookahead path the target agrees with is accepted too;
  - the Jacobi update takes the target's argmax also when sampling (the paper's sampling variant samples it).
Every node is a deterministic function of the committed history (q one-hot), so verification is the existing
tree path and exact: greedy output is plain greedy output; sampled output is distributed as the target's
(verify.tree_sampled, case a).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.config import MAX_SPECULATIVE_TOKENS
from specjax.drafters.base import Context, Draft, last_tokens
from specjax.drafters.registry import BuildRequest, DrafterSpec, Option, register
from specjax.sampling import greedy_token
from specjax.trees import Tree

MAX_POOL_BYTES = 1 << 30        # the n-gram pool of one generate() call (all rows), see _build


class LookaheadState(NamedTuple):
    window: jax.Array     # [B, N-1, W] Jacobi levels, oldest first
    pool: jax.Array       # [B, V, G, N-1] continuations of each first token; -1 = empty slot
    pointer: jax.Array    # [B, V] next slot to overwrite per key (FIFO)


def pool_insert(pool: jax.Array, pointer: jax.Array, key: jax.Array, cont: jax.Array,
                ok: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Insert one n-gram per row: key [B] first token, cont [B, N-1] the rest, ok [B] whether to insert. Skips an
    n-gram already pooled under its key (or with a missing token), else overwrites the key's oldest slot."""
    B, V, G, _ = pool.shape
    rows = jnp.arange(B)
    key_c = jnp.clip(key, 0, V - 1)
    slots = pool[rows, key_c]                                                  # [B, G, N-1]
    dup = jnp.any(jnp.all(slots == cont[:, None, :], axis=-1), axis=-1)
    write = ok & ~dup & (key >= 0) & (key < V) & jnp.all(cont >= 0, axis=-1)
    p = pointer[rows, key_c]
    pool = pool.at[rows, key_c, p].set(jnp.where(write[:, None], cont, slots[rows, p]))
    return pool, pointer.at[rows, key_c].set(jnp.where(write, (p + 1) % G, p))


def insert_text_ngram(pool: jax.Array, pointer: jax.Array, tokens: jax.Array, end: jax.Array,
                      ok: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The committed n-gram tokens[end - N + 1 .. end] per row (tokens [B, L], end [B]), where it exists."""
    n = pool.shape[-1] + 1
    idx = end[:, None] - n + 1 + jnp.arange(n)[None, :]                         # [B, N]
    gram = jnp.take_along_axis(tokens, jnp.maximum(idx, 0), axis=1)
    return pool_insert(pool, pointer, gram[:, 0], gram[:, 1:], ok & (idx[:, 0] >= 0))


@functools.lru_cache(maxsize=None)
def tree_layout(W: int, N: int, G: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parents [T], depths [T], mask [T, T]) of the step's tree; node 1 + j*W + i is lookahead token (j, i),
    node 1 + (N-1)*W + g*(N-1) + s is step s of guess g."""
    T = 1 + (W + G) * (N - 1)
    parents, depths = np.full(T, -1, np.int32), np.zeros(T, np.int32)
    look = lambda j, i: 1 + j * W + i
    for j in range(N - 1):
        for i in range(W):
            parents[look(j, i)] = 0 if i == 0 else look(max(j - 1, 0), i - 1)
            depths[look(j, i)] = i + 1
    for g in range(G):
        for s in range(N - 1):
            t = 1 + (N - 1) * W + g * (N - 1) + s
            parents[t] = 0 if s == 0 else t - 1
            depths[t] = s + 1
    mask = np.eye(T, dtype=bool)
    for t in range(1, T):                               # parents come first
        mask[t] |= mask[parents[t]]
    for a in (parents, depths, mask):
        a.setflags(write=False)
    return parents, depths, mask


@dataclasses.dataclass(frozen=True)
class LookaheadDrafter:
    k: int                   # (W + G)(N - 1): every node of the step's tree besides the root
    window_size: int         # W
    ngram_size: int          # N
    guess_set_size: int      # G
    vocab_size: int
    target_layers = ()                # reads nothing of the target but its tokens
    target_weights = ()

    # params: (); state: LookaheadState

    @property
    def max_depth(self) -> int:
        return max(self.window_size, self.ngram_size - 1)

    def _look(self, j: int, i: int) -> int:
        return 1 + j * self.window_size + i

    def init(self, params, ctx: Context, target_out, sp) -> LookaheadState:
        B, L = ctx.tokens.shape
        W, N, G = self.window_size, self.ngram_size, self.guess_set_size
        # Window from prompt tokens (the paper starts from random prompt tokens; any start is exact).
        pos = (jnp.arange(N - 1)[:, None] + jnp.arange(W)[None, :])[None] % ctx.length[:, None, None]
        window = jnp.take_along_axis(ctx.tokens, pos.reshape(B, -1), axis=1).reshape(B, N - 1, W)
        pool = jnp.full((B, self.vocab_size, G, N - 1), -1, jnp.int32)
        pointer = jnp.zeros((B, self.vocab_size), jnp.int32)
        P = int(target_out.hidden.shape[1])             # padded prompt width (static)

        def seed(e, carry):                             # the prompt's n-grams (and the first generated token's)
            pool, pointer = carry
            end = jnp.full((B,), e, jnp.int32)
            return insert_text_ngram(pool, pointer, ctx.tokens, end, end < ctx.length)

        pool, pointer = lax.fori_loop(0, P + 1, seed, (pool, pointer))
        return LookaheadState(window, pool, pointer)

    def propose(self, params, state: LookaheadState, ctx: Context, keys, sp):
        B = ctx.tokens.shape[0]
        W, N, G = self.window_size, self.ngram_size, self.guess_set_size
        root = last_tokens(ctx, 1)[:, 0]                                           # [B]
        guesses = state.pool[jnp.arange(B), jnp.clip(root, 0, self.vocab_size - 1)]  # [B, G, N-1]
        guesses = jnp.where(guesses >= 0, guesses, root[:, None, None])            # empty slot: any valid token
        tokens = jnp.concatenate([root[:, None], state.window.reshape(B, -1), guesses.reshape(B, -1)], axis=1)
        parents, depths, mask = tree_layout(W, N, G)
        T = parents.shape[0]
        rows = lambda a: jnp.broadcast_to(jnp.asarray(a), (B,) + a.shape)
        tree = Tree(tokens=tokens.astype(jnp.int32), parents=rows(parents), depths=rows(depths), mask=rows(mask),
                    scores=jnp.zeros((B, T), jnp.float32), source=rows(np.arange(-1, T - 1, dtype=np.int32)),
                    max_depth=self.max_depth)
        return Draft(tree.tokens[:, 1:], None, tree), state

    def commit(self, params, state: LookaheadState, ctx: Context, num_accepted, target_out, verified):
        W, N = self.window_size, self.ngram_size
        guess = greedy_token(verified.out.logits)                                  # [B, T] target's next token
        window, pool, pointer = state
        ok = jnp.ones(guess.shape[:1], bool)
        # Trajectories: each full diagonal of the old window plus the target's output after its last token.
        for i in range(N - 2, W):
            diag = jnp.stack([window[:, j, i - (N - 2) + j] for j in range(N - 1)], axis=1)     # [B, N-1]
            cont = jnp.concatenate([diag[:, 1:], guess[:, self._look(N - 2, i)][:, None]], axis=1)
            pool, pointer = pool_insert(pool, pointer, diag[:, 0], cont, ok)
        # Jacobi step: the new level is the target's output one position on; the oldest level is dropped.
        new = jnp.concatenate([guess[:, :1], guess[:, self._look(N - 2, 0):self._look(N - 2, W - 1)]], axis=1)
        window = jnp.concatenate([window[:, 1:], new[:, None, :]], axis=1)
        # The committed text's n-grams ending at the tokens this step committed (count <= num_accepted + 1).
        for j in range(self.max_depth + 1):
            pool, pointer = insert_text_ngram(pool, pointer, ctx.tokens, ctx.length - 1 - j, j <= num_accepted)
        return LookaheadState(window, pool, pointer)


def _int_in(lo: int, hi: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


OPTIONS = {
    "window_size": Option(4, _int_in(1, 63), "W, the lookahead window (tokens per Jacobi level): an int in [1, 63]"),
    "ngram_size": Option(3, _int_in(2, 33), "N, the n-gram size (N - 1 Jacobi levels; verified n-grams add up to "
                                            "N - 1 tokens): an int in [2, 33]"),
    "guess_set_size": Option(4, _int_in(1, 63), "G, pooled n-grams verified per step: an int in [1, 63]"),
}


def nodes_per_step(config) -> int:
    W, N, G = (config.option(n) for n in ("window_size", "ngram_size", "guess_set_size"))
    return (W + G) * (N - 1)


def _validate(config) -> None:
    W, N, G = (config.option(n) for n in ("window_size", "ngram_size", "guess_set_size"))
    if W < N - 1:
        raise ValueError(f"lookahead: window_size={W} must be >= ngram_size - 1 = {N - 1}, or no Jacobi trajectory "
                         "spans a whole n-gram")
    k = nodes_per_step(config)
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"lookahead: (window_size + guess_set_size) * (ngram_size - 1) = ({W} + {G}) * {N - 1} = "
                         f"{k} tokens verified per step > {MAX_SPECULATIVE_TOKENS}; lower window_size, "
                         "guess_set_size or ngram_size")


def _build(req: BuildRequest):
    if req.drafter is not None:
        raise ValueError("method='lookahead' takes no drafter; it drafts from Jacobi iterations of the target")
    cfg = req.config
    W, N, G = (cfg.option(n) for n in ("window_size", "ngram_size", "guess_set_size"))
    V = req.target.config.vocab_size
    pool_bytes = len(req.prompts) * V * G * (N - 1) * 4
    if pool_bytes > MAX_POOL_BYTES:
        raise ValueError(f"lookahead: the n-gram pool ({len(req.prompts)} requests x vocabulary {V} x "
                         f"guess_set_size={G} x (ngram_size - 1)={N - 1} int32) needs {pool_bytes / 2**30:.1f} GiB "
                         f"> {MAX_POOL_BYTES / 2**30:.0f} GiB; lower guess_set_size or ngram_size, or the batch")
    return LookaheadDrafter(cfg.k, W, N, G, V), ()


register(DrafterSpec("lookahead", _build, options=OPTIONS, validate=_validate, derive_k=nodes_per_step))
