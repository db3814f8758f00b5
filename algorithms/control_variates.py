"""SCAFFOLD control variates, option II (Karimireddy et al. 2020; spec 004 Alg. 1).

The server keeps c = (1/N) Σ_i c_i and broadcasts it; client i keeps c_i (0 at cold start).
Each local step follows −(∇f_i(y) − c_i + c); afterwards, with K local steps at lr η_l,

    c_i⁺ = c_i − c + (x − y_K) / (K η_l)          (option II: the mean local gradient)

and the client uploads Δc_i = c_i⁺ − c_i beside its model delta. The server then sets
c ← c + (1/N) Σ_{i∈S} Δc_i, which keeps c equal to the mean of all clients' c_i.
"""

from __future__ import annotations

import torch


def local_correction(server_control: torch.Tensor, client_control: torch.Tensor) -> torch.Tensor:
    """The term added to every local gradient: c − c_i."""
    return server_control - client_control


def updated_client_control(
    client_control: torch.Tensor,
    server_control: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    steps: int,
    lr: float,
) -> torch.Tensor:
    """c_i⁺ = c_i − c + (x − y_K)/(K η_l)."""
    return client_control - server_control + (start - end) / (steps * lr)


def updated_server_control(
    server_control: torch.Tensor, sum_control_deltas: torch.Tensor, num_clients: int
) -> torch.Tensor:
    """c⁺ = c + (1/N) Σ_{i∈S} Δc_i."""
    return server_control + sum_control_deltas / num_clients
