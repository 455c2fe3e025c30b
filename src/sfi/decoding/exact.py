"""Exact mode: fast steps draft, one dense forward verifies.

Self-speculative decoding with SFI's memory as the drafter. A round of a batch:

1. **draft**: gamma fast steps over the current memory (sink + selected + recent per KV head)
   propose ``d_1 .. d_gamma`` (``sfi.hf.plan.DRAFT``: no slow step, no probe, no state change);
2. **verify**: the drafts' KV is forgotten (:meth:`SlowFastCache.rewind`), and one forward of
   ``[x, d_1 .. d_gamma]`` attends densely over the whole cache (``sfi.hf.plan.VERIFY``). It
   writes full attention's KV for those positions, and where a refresh is due it is also the
   slow step: its queries are the Selector's evidence, its memory laid out at its first
   position;
3. **accept**: greedy keeps the drafts on which full attention's argmax agrees and then full
   attention's own token (:func:`greedy_verdict`); sampling keeps a draft with probability
   ``min(1, p / q)`` and else draws from ``max(0, p - q)`` normalised, or from ``p`` after
   ``gamma`` acceptances (:func:`speculative_verdict`), so that every token is distributed as
   full attention's (Leviathan et al. 2023; Chen et al. 2023);
4. **commit**: each row keeps its own accepted drafts and then its token at that position
   (full attention's, or after gamma acceptances its next one): row r commits ``a_r + 1``
   inputs. A batch shares one cache length, so the cache is rewound to the longest commit
   ``m + 1`` (``m``: the most drafts a row still wanted accepted) and a row that committed
   fewer leaves **holes**: slots zeroed and never attended (:mod:`sfi.hf.visibility`,
   :meth:`SlowFastCache.commit_rows`). Each row's trigger walks its committed inputs
   (:meth:`SlowFastCache.record_exact`); the round returns each row's tokens
   (:class:`Emitted`).

:class:`DraftLength` picks gamma per batch from the measured draft, verify and dense step
times and each row's own acceptance, and decodes densely where drafting cannot pay.

Shapes: B sequences, g drafts (gamma), V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from sfi.core.draft_length import DraftLength
from sfi.core.sequence_policy import sparse_pays
from sfi.decoding.decode_step import Sampling, block_logits, decode_one, extended_mask, sample_next
from sfi.errors import SFIError
from sfi.hf.plan import DENSE_STEP, DRAFT, VERIFY
from sfi.hf.slowfast_cache import SlowFastCache


@dataclass(frozen=True)
class Verdict:
    """What full attention says of one round's drafts.

    Attributes:
        accepted: ``[B]`` how many leading drafts each row keeps (0 .. g).
        fix: ``[B]`` each row's token at position ``accepted``: full attention's correction,
            or, after g acceptances, its next token (the bonus).
    """

    accepted: torch.Tensor
    fix: torch.Tensor


def greedy_verdict(target: torch.Tensor, drafts: torch.Tensor) -> Verdict:
    """Greedy verification: ``target [B, g + 1, V]`` full attention's logits at the verified
    positions, ``drafts [B, g]`` -> the longest prefix on which its argmax agrees."""
    best = target.argmax(dim=-1)  # [B, g + 1]
    accepted = (best[:, :-1] == drafts).long().cumprod(dim=-1).sum(dim=-1)
    return Verdict(accepted, best.gather(1, accepted[:, None]).squeeze(1))


def speculative_verdict(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                        generator: torch.Generator | None = None) -> Verdict:
    """Speculative sampling: ``p [B, g + 1, V]`` full attention's distributions at the verified
    positions, ``q [B, g, V]`` the drafter's (both normalised), ``drafts [B, g]`` drawn from
    ``q``. Draft j is kept while ``u_j < p_j(d_j) / q_j(d_j)`` (``u_j`` uniform); at the first
    rejection the token is drawn from ``max(0, p_j - q_j)`` normalised, after g acceptances
    from ``p_g``: each token is then distributed as ``p``."""
    b, g = drafts.shape
    p_draft = p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)  # [B, g]
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(b, g, generator=generator, device=p.device)
    accepted = (u * q_draft < p_draft).long().cumprod(dim=-1).sum(dim=-1)
    at = accepted.clamp(max=g - 1)
    rows = torch.arange(b, device=p.device)
    residual = (p[rows, at] - q[rows, at]).clamp(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q at that position: draw from p
    residual = torch.where(empty, p[rows, at], residual)
    target = torch.where((accepted == g)[:, None], p[:, -1], residual)
    fix = torch.multinomial(target, 1, generator=generator).squeeze(-1)
    return Verdict(accepted, fix)


@dataclass(frozen=True)
class Emitted:
    """The tokens one round gives each row.

    Attributes:
        tokens: ``[B, n]``; row r's are the first ``counts[r]``, the rest repeat its last.
        counts: ``[B]`` how many tokens each row took (1 .. n); a row also wrote that many
            slots of the round's n (the rest are its holes).
    """

    tokens: torch.Tensor
    counts: torch.Tensor

    @property
    def last(self) -> torch.Tensor:
        """``[B]`` each row's last token (the next round's input)."""
        return self.tokens.gather(1, (self.counts - 1)[:, None]).squeeze(1)

    def slots(self) -> torch.Tensor:
        """``[B, n]`` long: 1 where the round wrote a row's slot, 0 at its holes (what an
        attention mask covering the cache gains)."""
        columns = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return (columns[None, :] < self.counts[:, None]).long()

    def rows(self) -> list[list[int]]:
        """Each row's tokens, as lists."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.counts.tolist())]


def _groups(samplings: Sequence[Sampling]) -> list[tuple[Sampling, list[int]]]:
    """The rows of each distinct ``Sampling`` object, in first-seen order."""
    found: dict[int, tuple[Sampling, list[int]]] = {}
    for row, sampling in enumerate(samplings):
        found.setdefault(id(sampling), (sampling, []))[1].append(row)
    return list(found.values())


@dataclass
class RoundCounts:
    """What one :meth:`ExactDecoder.advance` did, summed over the batch's rows: verify
    forwards, tokens drafted and accepted, dense steps (rows x steps)."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    dense_steps: int = 0


class ExactDecoder:
    """Rounds of draft, verify, accept over one :class:`SlowFastCache` batch.

    Args:
        model: the routed transformers model the cache was built for.
        cache: its :class:`SlowFastCache` (prefilled).
        sampling: how every row draws (:class:`Sampling`; the default is greedy); a call of
            :meth:`advance` may give each row its own.

    :attr:`last` says what the last :meth:`advance` did (a server's metrics add it up).
    """

    def __init__(self, model: torch.nn.Module, cache: SlowFastCache,
                 sampling: Sampling | None = None):
        if not isinstance(cache, SlowFastCache):
            raise SFIError("exact mode decodes through a SlowFastCache")
        if cache.config.repair_tokens:
            raise SFIError("repair_tokens is for lossy SFI: exact mode's verify writes full "
                           "attention's KV already (set repair_tokens=0)")
        self.model, self.cache = model, cache
        self.sampling = sampling or Sampling()
        self.length = DraftLength(cache.config)
        self.last = RoundCounts()

    def advance(self, tokens: torch.Tensor, position: torch.Tensor,
                attention_mask: torch.Tensor | None, active: list[bool], room: int,
                samplings: Sequence[Sampling] | None = None) -> Emitted:
        """Feed ``tokens [B]`` (the last token of each row, not yet cached, at ``position + 1``
        per row; ``attention_mask [B, T]`` covers the cache, 0 at padding and holes, when
        there are any) and return the tokens that follow, at least one per row, each full
        attention's (``room``: tokens still wanted; ``active``: rows still wanted, the ones
        whose acceptance sets the round's length; ``samplings``: each row's, else the
        decoder's for all)."""
        if samplings is None:
            samplings = [self.sampling] * tokens.shape[0]
        elif len(samplings) != tokens.shape[0]:
            raise SFIError(f"{len(samplings)} samplings for a batch of {tokens.shape[0]} rows")
        groups = _groups(samplings)
        acceptances = self._acceptances(active)
        gamma = self.length.choose(room, acceptances) if self._can_draft() else 0
        try:
            if gamma == 0:
                return self._dense_step(tokens, position, attention_mask, groups, acceptances)
            return self._round(gamma, tokens, position, attention_mask, active, groups)
        finally:
            self.cache.phase = None

    def rounds(self, tokens: torch.Tensor, position: torch.Tensor,
               attention_mask: torch.Tensor | None,
               wanted: Callable[[], tuple[list[bool], int]]) -> Iterator[Emitted]:
        """:meth:`advance` round after round from ``tokens [B]`` at ``position + 1`` (and the
        padded ``attention_mask [B, T]``, extended as the cache grows): yields each round's
        :class:`Emitted`, whose last tokens the next round feeds, for as long as the caller
        takes them. ``wanted()``, asked before each round, gives its ``active`` rows and
        ``room``."""
        while True:
            active, room = wanted()
            emitted = self.advance(tokens, position, attention_mask, active, room)
            yield emitted
            position, tokens = position + emitted.counts, emitted.last
            if attention_mask is not None:  # (the cache keeps the holes: sfi.hf.visibility)
                attention_mask = torch.cat([attention_mask, emitted.slots().to(attention_mask)],
                                           dim=-1)

    def _acceptances(self, active: list[bool]) -> list[float]:
        """The per-token acceptance of each row still wanted (of every row when none is)."""
        rates = [seq.acceptance.rate for seq in self.cache.planner.sequences]
        return [a for a, alive in zip(rates, active) if alive] or rates

    def _can_draft(self) -> bool:
        total = self.cache.get_seq_length() + 1
        return any(sparse_pays(seq, total) for seq in self.cache.planner.sequences)

    def _dense_step(self, tokens: torch.Tensor, position: torch.Tensor,
                    attention_mask: torch.Tensor | None,
                    groups: list[tuple[Sampling, list[int]]],
                    acceptances: list[float]) -> Emitted:
        start = time.perf_counter()
        self.cache.phase = DENSE_STEP
        logits = decode_one(self.model, self.cache, tokens, position + 1,
                            extended_mask(attention_mask, 1))
        nxt = torch.empty_like(tokens)
        for sampling, rows in groups:
            nxt[rows] = sample_next(logits[rows], sampling.temperature, sampling.top_p,
                                    sampling.generator)
        inputs = tokens.tolist()
        self.length.record_dense(time.perf_counter() - start, acceptances)
        self.cache.record_exact([[t] for t in inputs], None, 0)
        self.last = RoundCounts(dense_steps=len(inputs))
        return Emitted(nxt[:, None], torch.ones_like(nxt))

    @staticmethod
    def _draw(logits: torch.Tensor, groups: list[tuple[Sampling, list[int]]]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft step's ``[B]`` tokens from its ``logits [B, V]``, and ``[B, V]`` the
        distributions the sampled rows drew from (None when every row is greedy)."""
        token = logits.argmax(dim=-1)
        q = None
        for sampling, rows in groups:
            if sampling.greedy:
                continue
            if q is None:
                q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            q[rows] = sampling.distribution(logits[rows])
            token[rows] = torch.multinomial(q[rows], 1, generator=sampling.generator
                                            ).squeeze(-1)
        return token, q

    @staticmethod
    def _verdict(target: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor | None,
                 groups: list[tuple[Sampling, list[int]]]) -> Verdict:
        """Each group's verdict (greedy, or speculative against its drafts' ``q``)."""
        accepted = torch.empty(drafted.shape[0], dtype=torch.long, device=drafted.device)
        fix = torch.empty_like(accepted)
        for sampling, rows in groups:
            if sampling.greedy:
                verdict = greedy_verdict(target[rows], drafted[rows])
            else:
                verdict = speculative_verdict(sampling.distribution(target[rows]), q[rows],
                                              drafted[rows], sampling.generator)
            accepted[rows], fix[rows] = verdict.accepted, verdict.fix
        return Verdict(accepted, fix)

    def _round(self, gamma: int, tokens: torch.Tensor, position: torch.Tensor,
               attention_mask: torch.Tensor | None, active: list[bool],
               groups: list[tuple[Sampling, list[int]]]) -> Emitted:
        cache, b = self.cache, tokens.shape[0]
        start_length = cache.get_seq_length()
        start = time.perf_counter()
        cache.phase = DRAFT
        drafts, qs = [], []
        token = tokens
        for j in range(gamma):
            logits = decode_one(self.model, cache, token, position + 1 + j,
                                extended_mask(attention_mask, j + 1))
            token, q = self._draw(logits, groups)
            drafts.append(token)
            qs.append(q)
        drafted = torch.stack(drafts, dim=1)  # [B, g]
        drafted.tolist()  # the drafts are done (a sync on GPUs), for the timing
        draft_s = time.perf_counter() - start

        start = time.perf_counter()
        cache.rewind(start_length)  # the drafts' KV: computed from sparse attention
        cache.phase = VERIFY
        ids = torch.cat([tokens[:, None], drafted], dim=1)  # [B, g + 1]
        target = block_logits(self.model, cache, ids, position + 1,
                              extended_mask(attention_mask, gamma + 1), keep=gamma + 1)
        q = None if qs[0] is None else torch.stack(qs, dim=1)  # [B, g, V]
        verdict = self._verdict(target, drafted, q, groups)
        accepted = verdict.accepted.tolist()
        live = [n for n, alive in zip(accepted, active) if alive] or accepted
        # each row commits its own accepted drafts: the batch's cache keeps the longest
        # commit, the shorter ones leave holes; a row that no longer counts commits at most m
        m = max(live)
        commits = [min(n, m) for n in accepted]
        cache.rewind(start_length + m + 1)  # the positions after the longest commit
        cache.commit_rows(start_length, [c + 1 for c in commits])  # the shorter ones: holes
        committed = torch.tensor(commits, device=tokens.device)
        # row r's token at position c_r: an accepted draft where it accepted more (a row that
        # no longer counts), else full attention's
        later = drafted.gather(1, committed.clamp(max=gamma - 1)[:, None]).squeeze(1)
        last = torch.where(verdict.accepted > committed, later, verdict.fix)
        columns = torch.arange(m + 1, device=tokens.device)[None, :]
        emitted = torch.where(columns < committed[:, None],
                              torch.cat([drafted[:, :m], last[:, None]], dim=1), last[:, None])
        inputs = [row[: c + 1] for row, c in zip(ids.tolist(), commits)]
        verify_s = time.perf_counter() - start
        self.length.record_round(gamma, draft_s, verify_s)
        cache.record_exact(inputs, accepted, gamma)
        self.last = RoundCounts(verify_steps=b, drafted=gamma * b, accepted=sum(accepted))
        return Emitted(emitted, committed + 1)
