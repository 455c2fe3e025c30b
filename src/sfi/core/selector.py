"""The Selector of Slow-Fast Inference (docs/method.md section 3), as plain tensor functions.

For one layer, every sequence b and KV head h, over the middle region M = [lo, hi):

1. evidence f: power mean (alpha) over the evidence rows of the attention probabilities
   restricted to M, renormalised; (1b, beyond the paper: pooled along positions, so that a
   needle's whole span ranks with its peak);
2. prior r: softmax over M of  w_norm * (-gamma * log||k_i||) + w_pos * (-beta u^p + eta log(1-u));
3. fusion: s = (1 - lambda) f + lambda r with lambda* = <f, f - r> / ||f - r||^2, clipped;
4. soft-NMS on l = log s: l' = l - strength * max(0, max_{|j-i|<=radius} l(j) - l(i));
5. cross-head exclusivity: l'' = l' + strength * log softmax_h(l' / temperature);
6. top-K of l'' per KV head.

Shapes: B sequences, H KV heads, N evidence rows, T positions. Positions outside M carry
``candidates == False`` and never influence a candidate's score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sfi.core.config import SFIConfig
from sfi.core.pages import page_count, pages_of
from sfi.core.scorers import Evidence

NEG_INF = float("-inf")


def _inside(candidates: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T]`` float32: 1 at the candidates, 0 elsewhere."""
    return candidates[:, None, :].to(torch.float32)


def _normalise(x: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """Scale ``x [B, H, T]`` to sum to 1 over the candidates (``inside [B, 1, T]``, 1 at a
    candidate); uniform over them where it sums to 0."""
    x = x * inside
    total = x.sum(dim=-1, keepdim=True)
    uniform = inside / inside.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.where(total > 0, x / total.clamp(min=torch.finfo(x.dtype).tiny), uniform)


def evidence_distribution(logits: torch.Tensor, candidates: torch.Tensor,
                          alpha: float = 0.5, attention: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """Stage 1, the evidence f ``[B, H, T]`` from logits ``[B, H, N, T]``.

    p_r = softmax of row r over every key it may see, then restricted to M;
    f = ((1/N) sum_r p_r^alpha)^(1/alpha), renormalised over M (alpha = 0: geometric mean).
    Rows that may see nothing (padding queries) are left out of the mean. ``attention``: the p_r
    ``[B, H, N, T]`` where the caller has them already (the slow step's own softmax).
    """
    p = attention if attention is not None else torch.softmax(logits.float(), dim=-1)
    n = p.shape[-2]  # a row that sees nothing is NaN: nansum counts it as 0 (the division
    # by n including it is a constant factor, which the renormalisation takes off)
    if alpha == 0:  # the mean of log p over the rows that see something
        f = torch.exp(torch.log(p).nanmean(dim=-2).nan_to_num(nan=NEG_INF))
    elif alpha == 1:
        f = p.nansum(dim=-2) / n
    elif alpha == 0.5:
        f = (p.sqrt().nansum(dim=-2) / n).square()
    else:
        f = (p.pow(alpha).nansum(dim=-2) / n).pow(1.0 / alpha)
    return _normalise(f, _inside(candidates))  # restricting each p_r to M, or f: the same


def pool_positions(f: torch.Tensor, candidates: torch.Tensor, kernel: int,
                   mode: str = "max") -> torch.Tensor:
    """Stage 1b (beyond the paper), span-preserving evidence: ``f [B, H, T]`` pooled along
    positions over an odd ``kernel`` (max or average, same length), renormalised over M.

    A needle is a run of neighbouring tokens of which the queries single out one or two; the
    pooled evidence gives the run's neighbours their peak's mass, so the whole span ranks
    together (SnapKV and RocketKV pool for the same reason)."""
    if kernel <= 1:
        return f
    b, h, t = f.shape
    inside = _inside(candidates)
    flat = (f * inside).reshape(b * h, 1, t)
    pad = kernel // 2
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=False)
    return _normalise(pooled.reshape(b, h, t), inside)


def prior_distribution(key_norms: torch.Tensor, candidates: torch.Tensor, lo: torch.Tensor,
                       hi: torch.Tensor, *, gamma: float, w_norm: float, w_pos: float,
                       power: float, eta: float, beta: float) -> torch.Tensor:
    """Stage 2, the prior r ``[B, H, T]`` from key norms ``[B, H, T]`` and positions.

    u(i) = (i - lo) / (hi - lo - 1) in [0, 1];
    log r(i) = w_norm * (-gamma log||k_i||) + w_pos * (-beta u^p + eta log(1 - u)); softmax over M.
    """
    positions = torch.arange(key_norms.shape[-1], device=key_norms.device)
    span = (hi - lo - 1).clamp(min=1).to(torch.float32)
    u = ((positions[None, :] - lo[:, None]).float() / span[:, None]).clamp(0.0, 1.0)  # [B, T]
    log_r = torch.zeros((), dtype=torch.float32, device=key_norms.device)
    if w_norm != 0 and gamma != 0:
        log_r = (-w_norm * gamma) * torch.log(key_norms.float().clamp(min=1e-12))
    if w_pos != 0:
        positional = -beta * torch.exp(power * torch.log(u))  # u^p (0 at u = 0)
        if eta != 0:
            positional = positional + eta * torch.log1p(-u)
        log_r = log_r + w_pos * positional[:, None, :]
    log_r = log_r.expand_as(key_norms).masked_fill(~candidates[:, None, :], NEG_INF)
    return torch.softmax(log_r, dim=-1).nan_to_num(0.0)  # sums to 1 over M (0 where M is empty)


def fusion_weight(f: torch.Tensor, r: torch.Tensor, cap: float) -> torch.Tensor:
    """Stage 3a, lambda* = <f, f - r> / ||f - r||^2 clipped to [0, cap]: ``[B, H]``.

    The point of the segment from f to r with the smallest sum_i s(i)^2 (the flattest mixture in
    the Renyi-2 sense); lambda = 0 when f == r.
    """
    d = f - r
    numerator = (f * d).sum(dim=-1)
    denominator = (d * d).sum(dim=-1)
    safe = denominator.clamp(min=torch.finfo(denominator.dtype).tiny)
    lam = torch.where(denominator > 0, numerator / safe, torch.zeros_like(numerator))
    return lam.clamp(0.0, cap)


def fuse(f: torch.Tensor, r: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Stage 3b, s = (1 - lambda) f + lambda r, the minimiser of
    (1 - lambda) KL(f || s) + lambda KL(r || s). ``lam`` is ``[B, H]``."""
    lam = lam[..., None]
    return (1.0 - lam) * f + lam * r


def soft_nms(log_s: torch.Tensor, candidates: torch.Tensor, radius: int = 16,
             strength: float = 1.0) -> torch.Tensor:
    """Stage 4, soft non-maximum suppression along positions on ``log_s [B, H, T]``.

    m(i) = max of l over |j - i| <= radius within M; l'(i) = l(i) - strength * max(0, m(i) - l(i)).
    Local maxima keep their score; near-duplicates of a stronger neighbour are pushed down.
    """
    if strength == 0 or radius == 0:
        return log_s
    masked = log_s.masked_fill(~candidates[:, None, :], NEG_INF)
    b, h, t = masked.shape
    neighbourhood_max = F.max_pool1d(masked.reshape(b * h, 1, t), kernel_size=2 * radius + 1,
                                     stride=1, padding=radius).reshape(b, h, t)
    gap = (neighbourhood_max - masked).clamp(min=0.0)
    gap = torch.where(torch.isfinite(masked), gap, torch.zeros_like(gap))
    return masked - strength * gap


def exclusivity(log_s: torch.Tensor, candidates: torch.Tensor, temperature: float = 2.0,
                strength: float = 0.85, min_heads: int = 3) -> torch.Tensor:
    """Stage 5, cross-head exclusivity over the KV heads of a layer, on ``log_s [B, H, T]``.

    rho_h(i) = softmax over h of l'_h(i) / temperature; l''_h(i) = l'_h(i) + strength log rho_h(i).
    A position that several heads want is discounted for the heads that want it least.
    Skipped when the layer has fewer than ``min_heads`` KV heads (the paper: 2 or fewer).
    """
    if strength == 0 or log_s.shape[1] < min_heads:
        return log_s
    scaled = log_s / temperature
    log_total = scaled[:, 0]  # log sum_h exp(scaled_h), head by head (H is small)
    for h in range(1, scaled.shape[1]):
        log_total = torch.logaddexp(log_total, scaled[:, h])
    out = log_s + strength * (scaled - log_total[:, None])  # log rho_h
    return out.masked_fill(~candidates[:, None, :], NEG_INF)


def top_k_positions(scores: torch.Tensor, candidates: torch.Tensor,
                    k_per_row: torch.Tensor, page: int = 1,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 6, the K best candidates per (sequence, KV head), in increasing position order.

    Args:
        scores: ``[B, H, T]``, larger keeps; NaN and -inf at a candidate rank it last among
            candidates (it can still be chosen when fewer than K candidates score higher).
        candidates: ``[B, T]`` bool.
        k_per_row: ``[B]`` how many to keep per sequence, at most the number of candidates.
        page: above 1, whole pages of ``page`` positions (aligned at position 0) are taken,
            ranked by their best candidate (:func:`selection_order`).
        keep: ``[B, H, T]`` bool, positions taken before any other (pinned, or kept by
            hysteresis), best first among themselves.

    Returns:
        ``(positions [B, H, k_max], valid [B, k_max])`` with k_max = max(k_per_row); slots
        ``j >= k_per_row[b]`` are invalid and hold the position of the first candidate.
    """
    order, valid = selection_order(scores, candidates, k_per_row, page, keep)
    return _sorted_slots(order, valid, candidates), valid


def _ranked(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Scores as float32 with NaN and -inf last among candidates, non-candidates at -inf."""
    lowest = torch.finfo(torch.float32).min
    ranked = scores.float().nan_to_num(nan=lowest, posinf=torch.finfo(torch.float32).max,
                                       neginf=lowest)
    return ranked.masked_fill(~candidates[:, None, :], NEG_INF)


def _sorted_slots(top: torch.Tensor, valid: torch.Tensor,
                  candidates: torch.Tensor) -> torch.Tensor:
    """Positions ``top [B, H, k]`` in increasing order, invalid slots last holding the first
    candidate."""
    t = candidates.shape[-1]
    top = top.masked_fill(~valid[:, None, :], t)  # invalid slots sort last
    top = torch.sort(top, dim=-1).values
    first_candidate = candidates.float().argmax(dim=-1)  # [B]
    return torch.where(top == t, first_candidate[:, None, None], top)


def rank_keys(scores: torch.Tensor, candidates: torch.Tensor, page: int = 1,
              shift: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, T]`` int64 order keys, smallest first: a candidate's rank by score (ties by
    position); with pages, ``page_rank * page + offset`` so that a page's positions follow each
    other, pages ranked by their best candidate (``shift [B]``: where each row's pages start,
    :func:`sfi.core.pages.page_shift`; None: at position 0). Non-candidates get a key larger than
    all."""
    b, h, t = scores.shape
    ranked = _ranked(scores, candidates)
    positions = torch.arange(t, device=scores.device)
    if page <= 1:
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
        keys = torch.empty_like(order).scatter_(-1, order, positions.expand(b, h, t))
    else:
        pages = page_count(t, page, shift)
        page_index = pages_of(t, page, shift, b, scores.device)[:, None, :].expand(b, h, t)
        best = ranked.new_full((b, h, pages), NEG_INF).scatter_reduce(
            -1, page_index, ranked, "amax")  # [B, H, P]
        order = torch.sort(best, dim=-1, descending=True, stable=True).indices
        page_rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(pages, device=scores.device).expand(b, h, pages))
        offset = positions if shift is None else (positions[None, :] + shift[:, None])[:, None]
        keys = page_rank.gather(-1, page_index) * page + offset % page
    limit = torch.iinfo(torch.int64).max
    return keys.masked_fill(~candidates[:, None, :], limit)


def selection_order(scores: torch.Tensor, candidates: torch.Tensor, k_per_row: torch.Tensor,
                    page: int = 1, keep: torch.Tensor | None = None,
                    pinned: torch.Tensor | None = None, shift: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 6: ``(order [B, H, k_max], valid [B, k_max])``, the chosen positions best first:
    ``pinned`` ones first, then ``keep`` ones, then whole pages in rank order (each group in
    its own rank order; pages start as ``shift`` says, :func:`rank_keys`); see
    :func:`top_k_positions`."""
    b, t = scores.shape[0], scores.shape[-1]
    k_max = int(k_per_row.max().item()) if b else 0
    valid = torch.arange(k_max, device=scores.device)[None, :] < k_per_row[:, None]
    if page <= 1 and keep is None and pinned is None:
        return torch.topk(_ranked(scores, candidates), k_max, dim=-1).indices, valid
    if keep is None and pinned is None:
        return _best_pages_order(scores, candidates, k_per_row, k_max, page, shift), valid
    keys = rank_keys(scores, candidates, page, shift)
    span = page_count(t, page, shift) * page  # every candidate's key is below this
    tier = torch.full_like(keys, 2)
    for rank, chosen in ((1, keep), (0, pinned)):
        if chosen is not None:
            tier = tier.masked_fill(chosen & candidates[:, None, :], rank)
    keys = torch.where(keys == torch.iinfo(torch.int64).max, keys, keys + tier * span)
    return torch.topk(keys, k_max, dim=-1, largest=False).indices, valid


def _best_pages_order(scores: torch.Tensor, candidates: torch.Tensor, k_per_row: torch.Tensor,
                      k_max: int, page: int, shift: torch.Tensor | None) -> torch.Tensor:
    """``[B, H, k_max]``: :func:`selection_order` by whole pages without pinned or kept
    positions, the same positions in the same order as the smallest :func:`rank_keys`, found in
    page space (:func:`_chosen_pages`)."""
    start, usable = _chosen_pages(scores, candidates, k_per_row, page, shift)
    positions, usable = _expanded(start, usable, scores.shape[-1])
    rank = usable.cumsum(-1) - 1  # each usable position's place in the order
    slot = torch.where(usable & (rank < k_max), rank, k_max)
    out = positions.new_zeros(*positions.shape[:2], k_max + 1).scatter_(-1, slot, positions)
    return out[..., :k_max]


def best_pages_slots(scores: torch.Tensor, candidates: torch.Tensor, k_per_row: torch.Tensor,
                     page: int, shift: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, k_max]``, what :func:`compact_slots` makes of the whole-page
    :func:`selection_order` without pins or kept positions (increasing positions, slots past a
    row's k holding its first candidate), without sorting positions: the chosen pages are put
    in position order and their kept positions packed."""
    b, h, t = scores.shape
    k_max = int(k_per_row.max()) if b else 0
    start, usable = _chosen_pages(scores, candidates, k_per_row, page, shift)
    flat = usable.flatten(-2)
    kept = flat & (flat.cumsum(-1) <= k_per_row[:, None, None])  # the first k in rank order
    by_position = start.argsort(dim=-1)
    start = start.gather(-1, by_position)
    kept = kept.view(usable.shape).gather(2, by_position[..., None].expand(usable.shape))
    positions, kept = _expanded(start, kept, t)
    slot = torch.where(kept, kept.cumsum(-1) - 1, k_max)
    first_candidate = candidates.float().argmax(dim=-1)  # [B]
    out = first_candidate[:, None, None].expand(b, h, k_max + 1).clone()
    return out.scatter_(-1, slot, positions)[..., :k_max]


def _chosen_pages(scores: torch.Tensor, candidates: torch.Tensor, k_per_row: torch.Tensor,
                  page: int, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The best pages that hold every row's k candidates, best first: ``(start [B, H, m]``, each
    page's first position (negative for a row's first, shifted page), ``usable [B, H, m,
    page]``, its positions that lie in the cache and are candidates). Pages are ranked by their
    best candidate (ties by position), as :func:`rank_keys`; about K / page pages are expanded,
    not T / page."""
    b, h, t = scores.shape
    pages = page_count(t, page, shift)
    ranked = _ranked(scores, candidates)
    counts = candidates.to(torch.int32)
    if shift is None:  # pages are contiguous runs (the last one may be short)
        best = F.max_pool1d(ranked.view(b * h, 1, t), page, page, ceil_mode=True)
        best = best.view(b, h, pages)
        counts = F.pad(counts, (0, pages * page - t)).view(b, pages, page).sum(-1)
    else:
        page_index = pages_of(t, page, shift, b, scores.device)  # [B, T]
        best = ranked.new_full((b, h, pages), NEG_INF).scatter_reduce(
            -1, page_index[:, None, :].expand(b, h, t), ranked, "amax")
        counts = counts.new_zeros(b, pages).scatter_add_(-1, page_index, counts)
    order = torch.sort(best, dim=-1, descending=True, stable=True).indices  # [B, H, P]
    held = counts[:, None, :].expand(b, h, pages).gather(-1, order).cumsum(-1)
    needed = int((held < k_per_row[:, None, None]).sum(-1).max()) + 1 if b else 1
    m = min(needed, pages)
    start = order[..., :m] * page  # [B, H, m]
    if shift is not None:
        start = start - shift[:, None, None]
    positions = start[..., None] + torch.arange(page, device=scores.device)  # [B, H, m, page]
    inside = (positions >= 0) & (positions < t)
    flat = positions.clamp(0, t - 1).flatten(-2)
    usable = inside & candidates[:, None, :].expand(b, h, t).gather(-1, flat).view(inside.shape)
    return start, usable


def _expanded(start: torch.Tensor, usable: torch.Tensor, t: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages ``start [B, H, m]`` with ``usable [B, H, m, page]`` as positions ``[B, H, m *
    page]`` (clamped into the cache) and their usable flags, flattened."""
    page = usable.shape[-1]
    positions = start[..., None] + torch.arange(page, device=start.device)
    return positions.clamp(0, t - 1).flatten(-2), usable.flatten(-2)


def compact_slots(order: torch.Tensor, valid: torch.Tensor, candidates: torch.Tensor,
                  pins: torch.Tensor) -> torch.Tensor:
    """The slots of a compact memory from a selection best first ``order [B, H, k]``: each
    row's first ``pins[b]`` (its pinned positions) in increasing position order, then the rest
    in increasing order; invalid slots last, holding the first candidate."""
    if not bool((pins > 0).any()):
        return _sorted_slots(order, valid, candidates)
    t = candidates.shape[-1]
    slot = torch.arange(order.shape[-1], device=order.device)
    rest = (slot[None, :] >= pins[:, None]).long()[:, None, :]  # [B, 1, k]: not pinned
    keys = order.masked_fill(~valid[:, None, :], t) + rest * (t + 1)
    by_key = torch.sort(keys, dim=-1).indices
    top = order.gather(-1, by_key).masked_fill(~valid[:, None, :], t)
    first_candidate = candidates.float().argmax(dim=-1)
    return torch.where(top == t, first_candidate[:, None, None], top)


def hysteresis_keep(scores: torch.Tensor, candidates: torch.Tensor, k_per_row: torch.Tensor,
                    previous: torch.Tensor, hysteresis: float, page: int = 1,
                    shift: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, T]`` bool: the previously selected positions (``previous``, bool) that still
    rank within the top (1 + hysteresis) K of ``scores`` (pages as :func:`rank_keys`)."""
    keys = rank_keys(scores, candidates, page, shift)
    within = keys < ((1.0 + hysteresis) * k_per_row.float()).ceil().long()[:, None, None]
    return previous & within & candidates[:, None, :]


@dataclass(frozen=True)
class SFISelector:
    """The SFI Selector, stages 1-5 (stage 6, top-K, is shared by every scorer).

    Each stage can be switched off: ``nms_strength=0``, ``exclusivity_strength=0``,
    ``lambda caps = 0`` (pure evidence), ``w_norm = w_pos = 0`` (flat prior); ``pool_kernel``
    above 1 adds the span-preserving pooling of the evidence (stage 1b).
    """

    config: SFIConfig
    scores_rows_alone: ClassVar[bool] = True  # every stage works row by row (sfi.core.scorers)

    def stages(self, evidence: Evidence) -> dict[str, torch.Tensor]:
        """The score ``[B, H, T]`` after each stage, in order: ``evidence`` (f), ``pooled``
        (when on), ``fused`` (log s), ``nms``, ``exclusive`` (the final score)."""
        c = self.config
        m = evidence.candidates
        out: dict[str, torch.Tensor] = {}
        f = evidence_distribution(evidence.logits, m, c.alpha, evidence.probabilities)
        out["evidence"] = f
        if c.pool_kernel > 1:
            f = pool_positions(f, m, c.pool_kernel, c.pool)
            out["pooled"] = f
        r = prior_distribution(evidence.key_norms, m, evidence.lo, evidence.hi, gamma=c.gamma,
                               w_norm=c.w_norm, w_pos=c.w_pos, power=c.pos_power, eta=c.eta,
                               beta=c.beta)
        n_rows = evidence.logits.shape[-2]
        cap = c.lambda_cap_single if n_rows == 1 else c.lambda_cap_multi
        s = fuse(f, r, fusion_weight(f, r, cap))
        log_s = torch.log(s).masked_fill(~m[:, None, :], NEG_INF)
        out["fused"] = log_s
        log_s = soft_nms(log_s, m, c.nms_radius, c.nms_strength)
        out["nms"] = log_s
        out["exclusive"] = exclusivity(log_s, m, c.exclusivity_temperature,
                                       c.exclusivity_strength, c.exclusivity_min_heads)
        return out

    def score(self, evidence: Evidence) -> torch.Tensor:
        return self.stages(evidence)["exclusive"]
