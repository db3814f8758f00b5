"""Many clients' mini-batches of a round at once, bit for bit ``LocalTrainer.batches``.

``batch_sampling: fresh`` draws client i's step-k batch as ``torch.randperm(n_i, generator=g_i)
[:b_i]`` (b_i = min(B, n_i)), K_i times in a row: 10,000 small calls a round at 1,000 clients
of K = 10 (workload S), each paying the call's fixed cost. ``epoch`` draws one ``randperm(n_i)``
per epoch and takes its consecutive slices of b_i (the last one of an epoch shorter where b_i
does not divide n_i), ⌈K_i / ⌈n_i / b_i⌉⌉ permutations for K_i steps. On a CPU generator,
``randperm(n)`` is the Fisher–Yates shuffle

    p = [0, 1, …, n−1];  for i in 0 … n−2:  z = u_i mod (n − i),  swap p[i], p[i + z]

with u_0, u_1, … the generator's next n − 1 32-bit Mersenne-Twister words
(aten/src/ATen/native/TensorFactories.cpp, ``randperm_cpu``; n < 2³²/20). Both functions take
each client's words for all its shuffles in one call (``random_`` over the full int64 range
returns the words in pairs, the first as the high half: ``CPUGeneratorImpl::random64``), then
run the swaps of every client's shuffles together, one swap position at a time over all their
rows (``fresh``: only the first b_i, the positions a batch reads). Each generator ends where the
per-client calls leave it, and ``tests/test_round_batches.py`` checks the batches against
``LocalTrainer.batches`` for sizes, step counts and seeds (a torch that changed either kernel
would fail it).
"""

from __future__ import annotations

import torch

_LOW_WORD = 0xFFFFFFFF
SWAP_ENTRIES = 2**22  # the most int64 permutation entries one slice of clients holds (32 MiB)


def fresh_batches(
    sizes: list[int], steps: list[int], batch_size: int, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[n, max K_i, max b_i]`` record indices, ``[n, max K_i]`` batch sizes): row
    [i, k, :b_i] is client i's step-k batch, ``LocalTrainer.batches``' k-th ``fresh`` draw from
    ``generators[i]`` (CPU generators, each advanced past its K_i shuffles), size b_i for
    k < K_i and 0 after; padding 0."""
    widths = [min(batch_size, size) for size in sizes]
    ones = [1] * len(sizes)
    return _in_chunks(sizes, steps, steps, generators, [0] * len(sizes), widths, ones, widths)


def epoch_batches(
    sizes: list[int], steps: list[int], batch_size: int, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fresh_batches``' layout for ``epoch`` sampling: row [i, k, :b_ik] is client i's
    step-k batch, ``LocalTrainer.batches``' k-th ``epoch`` draw (b_ik = b_i but at the end of an
    epoch that b_i does not divide), each generator advanced past its permutations."""
    widths = [min(batch_size, size) for size in sizes]
    per_epoch = [-(-size // width) for size, width in zip(sizes, widths, strict=True)]
    epochs = [-(-k // s) for k, s in zip(steps, per_epoch, strict=True)]
    return _in_chunks(sizes, steps, epochs, generators, widths, widths, per_epoch, sizes)


def _in_chunks(
    sizes: list[int],
    steps: list[int],
    draws: list[int],
    generators: list[torch.Generator],
    stride: list[int],
    widths: list[int],
    per_draw: list[int],
    reads: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_batches`` of every client from its ``draws_i`` shuffles, correct in the first
    ``reads_i`` positions (those its batches read). The clients are taken in order of (n_i,
    draws_i), in chunks whose shuffles hold at most ``SWAP_ENTRIES`` entries (chunk length ·
    most draws · largest n_i; a larger client alone), so one large client does not make every
    client's rows that long."""
    index = torch.zeros(
        (len(sizes), max(steps, default=0), max(widths, default=0)), dtype=torch.int64
    )
    counts = torch.zeros(index.shape[:2], dtype=torch.int64)
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], draws[i]))
    columns = (sizes, steps, draws, generators, stride, widths, per_draw, reads)
    s, k, d, g, st, w, pd, r = ([column[i] for i in order] for column in columns)
    for part in _chunks(s, d):
        perm = _shuffles(s[part], d[part], g[part], max(r[part]))
        chunk, sized = _batches(perm, st[part], w[part], pd[part], s[part], k[part])
        rows = order[part]
        index[rows, : chunk.shape[1], : chunk.shape[2]] = chunk
        counts[rows, : sized.shape[1]] = sized
    return index, counts


def _chunks(sizes: list[int], draws: list[int]) -> list[slice]:
    """Consecutive runs of clients (sorted by size) whose shuffles hold at most
    ``SWAP_ENTRIES`` entries: run length · most draws · the run's last (largest) size."""
    chunks: list[slice] = []
    begin, most = 0, 0
    for i, (size, count) in enumerate(zip(sizes, draws, strict=True)):
        most = max(most, count)
        if i > begin and (i - begin + 1) * max(1, most) * size > SWAP_ENTRIES:
            chunks.append(slice(begin, i))
            begin, most = i, count
    if sizes:
        chunks.append(slice(begin, len(sizes)))
    return chunks


def _batches(
    perm: torch.Tensor,
    stride: list[int],
    widths: list[int],
    per_draw: list[int],
    sizes: list[int],
    steps: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[n, max K_i, max b_i]`` indices, ``[n, max K_i]`` batch sizes) read from ``perm``
    [n, draws, positions]: client i's step k is permutation k // ``per_draw[i]`` from position
    (k mod ``per_draw[i]``)·``stride[i]``, its first ``widths[i]`` entries that lie before
    ``sizes[i]``; none at k ≥ K_i; padding 0."""
    column = {"stride": stride, "width": widths, "per_draw": per_draw, "size": sizes}
    c = {name: torch.tensor(values)[:, None, None] for name, values in column.items()}
    k = torch.arange(max(steps))[None, :, None]
    t = torch.arange(max(widths))[None, None, :]
    position = (k % c["per_draw"]) * c["stride"] + t
    real = (t < c["width"]) & (position < c["size"]) & (k < torch.tensor(steps)[:, None, None])
    draw = (k // c["per_draw"]).clamp(max=perm.shape[1] - 1)
    flat = (draw * perm.shape[2] + position * real).flatten(1)
    index = perm.flatten(1).gather(1, flat).view(real.shape) * real
    return index, real.sum(2)


def _shuffles(
    sizes: list[int], draws: list[int], generators: list[torch.Generator], width: int
) -> torch.Tensor:
    """[g, max draws_i, max n_i]: each client's ``draws_i`` Fisher–Yates shuffles, correct in
    their first ``width`` positions, clients of one (n, draws) drawing their words together;
    beyond a client's own n_i − 1 offsets the padding is a zero offset (no swap)."""
    longest = max(sizes)
    z = torch.zeros((len(sizes), max(draws), longest - 1), dtype=torch.int64)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(zip(sizes, draws, strict=True)):
        groups.setdefault(shape, []).append(i)
    for (size, count), members in groups.items():
        z[members, :count, : size - 1] = _swap_offsets(
            [generators[i] for i in members], size, count
        )
    return _first_positions(z.flatten(0, 1), width).view(len(sizes), max(draws), longest)


def _swap_offsets(generators: list[torch.Generator], size: int, steps: int) -> torch.Tensor:
    """[g, K, n − 1]: the z = u_i mod (n − i) of K ``randperm(n)`` calls in a row on each of
    the g generators, from one draw of each one's K·(n − 1) words. With an odd count the last
    word (i = n − 2 of the last shuffle, where only u mod 2 counts) comes from one
    ``randperm(2)``, which takes exactly one word."""
    if any(generator.device.type != "cpu" for generator in generators):
        raise ValueError("round_batches reproduces randperm on CPU generators only")
    count = steps * (size - 1)
    pairs = torch.empty((len(generators), count // 2), dtype=torch.int64)
    parities = []
    for row, generator in zip(pairs, generators, strict=True):
        row.random_(-(2**63), None, generator=generator)
        if count % 2:
            parities.append(int(torch.randperm(2, generator=generator)[0]))
    words = torch.stack([(pairs >> 32) & _LOW_WORD, pairs & _LOW_WORD], dim=2).flatten(1)
    if count % 2:
        words = torch.cat([words, torch.tensor(parities)[:, None]], dim=1)
    return words.view(len(generators), steps, size - 1) % torch.arange(size, 1, -1)


def _first_positions(z: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, n]: each row's Fisher–Yates permutation of 0 … n−1 from its offsets ``z``
    [rows, n − 1], correct in its first ``width`` positions (the later swaps never touch
    them, so they are not run)."""
    rows, longest = z.shape[0], z.shape[1] + 1
    perm = torch.arange(longest).repeat(rows, 1)
    targets = z + torch.arange(longest - 1)
    for i in range(min(width, longest - 1)):
        target = targets[:, i : i + 1]
        current = perm[:, i : i + 1].clone()
        perm[:, i : i + 1] = perm.gather(1, target)
        perm.scatter_(1, target, current)
    return perm
