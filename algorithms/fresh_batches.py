"""Many clients' ``fresh`` mini-batches of a round at once, bit for bit ``LocalTrainer.batches``.

``batch_sampling: fresh`` draws client i's step-k batch as ``torch.randperm(n_i, generator=g_i)
[:b_i]`` (b_i = min(B, n_i)), K_i times in a row: 10,000 small calls a round at 1,000 clients
of K = 10 (workload S), each paying the call's fixed cost. On a CPU generator,
``randperm(n)`` is the Fisher–Yates shuffle

    p = [0, 1, …, n−1];  for i in 0 … n−2:  z = u_i mod (n − i),  swap p[i], p[i + z]

with u_0, u_1, … the generator's next n − 1 32-bit Mersenne-Twister words
(aten/src/ATen/native/TensorFactories.cpp, ``randperm_cpu``; n < 2³²/20). ``fresh_batches``
takes each client's K_i·(n_i − 1) words in one call (``random_`` over the full int64 range
returns the words in pairs, the first as the high half: ``CPUGeneratorImpl::random64``), then
runs the first b_i swaps of every client's K_i shuffles together, one swap position at a time
over all their rows. Each generator ends where the K_i ``randperm`` calls leave it, and
``tests/test_fresh_batches.py`` checks the batches against ``LocalTrainer.batches`` for
sizes, step counts and seeds (a torch that changed either kernel would fail it).
"""

from __future__ import annotations

import torch

_LOW_WORD = 0xFFFFFFFF
SWAP_ENTRIES = 2**22  # the most int64 permutation entries one slice of clients holds (32 MiB)


def fresh_batches(
    sizes: list[int], steps: list[int], batch_size: int, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[n, max K_i, max b_i]`` record indices, ``[n, max b_i]`` float mask of the real
    ones): row [i, k, :b_i] is client i's step-k batch, ``LocalTrainer.batches``' k-th draw
    from ``generators[i]`` (CPU generators, each advanced past its K_i shuffles); padding 0.
    Clients are shuffled in slices of at most ``SWAP_ENTRIES`` permutation entries."""
    widths = [min(batch_size, size) for size in sizes]
    index = torch.zeros((len(sizes), max(steps), max(widths)), dtype=torch.int64)
    per_slice = max(1, SWAP_ENTRIES // (max(steps) * max(sizes)))
    for start in range(0, len(sizes), per_slice):
        part = slice(start, start + per_slice)
        perm = _shuffles(sizes[part], steps[part], generators[part], max(widths[part]))
        width = min(perm.shape[2], index.shape[2])
        index[part, : perm.shape[1], :width] = perm[:, :, :width]
    mask = torch.arange(index.shape[2]) < torch.tensor(widths)[:, None]
    return index * mask[:, None, :], mask.float()


def _shuffles(
    sizes: list[int], steps: list[int], generators: list[torch.Generator], width: int
) -> torch.Tensor:
    """[g, max K_i, max n_i]: each client's K_i Fisher–Yates shuffles, correct in their first
    ``width`` positions, clients of one (n, K) drawing their words together; beyond a
    client's own n_i − 1 offsets the padding is a zero offset (no swap)."""
    longest = max(sizes)
    z = torch.zeros((len(sizes), max(steps), longest - 1), dtype=torch.int64)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(zip(sizes, steps, strict=True)):
        groups.setdefault(shape, []).append(i)
    for (size, k), members in groups.items():
        z[members, :k, : size - 1] = _swap_offsets([generators[i] for i in members], size, k)
    return _first_positions(z.flatten(0, 1), width).view(len(sizes), max(steps), longest)


def _swap_offsets(generators: list[torch.Generator], size: int, steps: int) -> torch.Tensor:
    """[g, K, n − 1]: the z = u_i mod (n − i) of K ``randperm(n)`` calls in a row on each of
    the g generators, from one draw of each one's K·(n − 1) words. With an odd count the last
    word (i = n − 2 of the last shuffle, where only u mod 2 counts) comes from one
    ``randperm(2)``, which takes exactly one word."""
    if any(generator.device.type != "cpu" for generator in generators):
        raise ValueError("fresh_batches reproduces randperm on CPU generators only")
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
