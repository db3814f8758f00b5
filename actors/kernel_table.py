"""What ``executor.vectorize: auto`` and ``channels_last: auto`` choose: a fixed table.

Keyed by (model kind, device type): the model kind is the task's model name (``models.MODELS``),
the device type torch's (``cpu``, ``cuda``). Every row is a measurement, or names the measured
model it follows; nothing is timed at run time, so the same config and seed run the same kernels
(and reproduce the same numbers) on every machine of a device type. ``benchmarks.gpu`` measures
the rows again (``--device cuda`` on a GPU machine, ``--device cpu`` here) and reports where the
faster path disagrees with the table; a row changes only by editing this file.

Measured (README, Benchmarks; ``../shared/reference/gpu-device.md``; ``benchmarks/NOTES.md``):

- cuda, MNIST CNN: vectorised 852 and 1,675 clients/s against sequential 110 and 225 (one
  H200, local executor, 500 clients, cohort 100, 5 steps; 2,000 clients, cohort 500, 2 steps
  of 4 rows): 7.4–7.8× → vectorised.
- cuda, ResNet-18 (GroupNorm), CIFAR-shaped inputs, cohort 50, 4 steps of batch 50 (one H200):
  vectorised 1.91 s/round, sequential 1.62 → sequential; channels-last 2.31 against 2.07 s/round
  → NCHW.
- cpu, logistic regression (workload B, 1,000 clients a round): vectorised 0.26 against 1.73
  s/round → vectorised.
- cpu, MNIST CNN (workload A, two host threads of one intra-op thread): vectorised 0.46 against
  0.44 s/round (grouped convolutions) → sequential; NHWC's batch-16 step 4.9–5.4 against 6.6–6.7
  ms → channels-last.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """The kernels ``auto`` picks for one (model kind, device type), and the evidence."""

    vectorize: bool
    channels_last: bool
    evidence: str


_CNN_CPU = Row(False, True, "as mnist_cnn on cpu (small 2-D convolutions)")
_CNN_CUDA = Row(True, False, "as mnist_cnn on cuda (small 2-D convolutions)")
_RESNET_CPU = Row(False, True, "as mnist_cnn on cpu: grouped convolutions lose, NHWC wins")
_RESNET_CUDA = Row(False, False, "as resnet18_gn on cuda")
_DENSE_CPU = Row(True, False, "as logreg on cpu (batched matrix products)")
_DENSE_CUDA = Row(True, False, "as mnist_cnn on cuda (many small kernels per client)")

TABLE: dict[tuple[str, str], Row] = {
    ("logreg", "cpu"): Row(True, False, "workload B: vectorised 0.26 vs 1.73 s/round"),
    ("logreg", "cuda"): _DENSE_CUDA,
    ("mlp_pca60", "cpu"): _DENSE_CPU,
    ("mlp_pca60", "cuda"): _DENSE_CUDA,
    ("mnist_cnn", "cpu"): Row(
        False, True, "workload A: vectorised 0.46 vs 0.44 s/round; NHWC step 4.9-5.4 vs 6.6 ms"
    ),
    ("mnist_cnn", "cuda"): Row(
        True, False, "H200: vectorised 852/1,675 vs sequential 110/225 clients/s (7.4-7.8x)"
    ),
    ("emnist_cnn", "cpu"): _CNN_CPU,
    ("emnist_cnn", "cuda"): _CNN_CUDA,
    ("reddi_cnn", "cpu"): _CNN_CPU,
    ("reddi_cnn", "cuda"): _CNN_CUDA,
    ("resnet18_gn", "cpu"): _RESNET_CPU,
    ("resnet18_gn", "cuda"): Row(
        False, False, "H200: vectorised 1.91 vs sequential 1.62 s/round; NHWC 2.31 vs 2.07"
    ),
    ("resnet18_gn2", "cpu"): _RESNET_CPU,
    ("resnet18_gn2", "cuda"): _RESNET_CUDA,
    ("resnet10_gn", "cpu"): _RESNET_CPU,
    ("resnet10_gn", "cuda"): _RESNET_CUDA,
    ("resnet9", "cpu"): _RESNET_CPU,
    ("resnet9", "cuda"): _RESNET_CUDA,
    # Unmeasured; with dropout both train sequentially whatever the setting (``vectorizable``).
    ("vit_b16", "cpu"): Row(False, True, "as mnist_cnn on cpu (patch-embedding convolution)"),
    ("vit_b16", "cuda"): _DENSE_CUDA,
    ("roberta_base", "cpu"): _DENSE_CPU,
    ("roberta_base", "cuda"): _DENSE_CUDA,
}
# A device type the table has no row for (e.g. mps): the plain kernels.
UNMEASURED = Row(False, False, "no row: one client at a time, NCHW")


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a host runs, each with where it came from: ``table`` (``auto``, the row
    ``key``) or ``config`` (set to true or false)."""

    vectorize: bool
    channels_last: bool
    vectorize_from: str
    channels_last_from: str
    key: str

    def params(self) -> dict[str, str]:
        """The choice as MLflow run parameters."""
        return {
            "kernels.vectorize": str(self.vectorize),
            "kernels.vectorize_from": self.vectorize_from,
            "kernels.channels_last": str(self.channels_last),
            "kernels.channels_last_from": self.channels_last_from,
            "kernels.table_row": f"{self.key}: {row(*self.key.split('/')).evidence}",
        }


def row(model_kind: str, device_type: str) -> Row:
    return TABLE.get((model_kind, device_type), UNMEASURED)


def choose(
    model_kind: str, device_type: str, vectorize: bool | str, channels_last: bool | str
) -> KernelChoice:
    """Each setting as configured, or ``auto``'s entry in ``TABLE`` for (model, device)."""
    found = row(model_kind, device_type)
    return KernelChoice(
        found.vectorize if vectorize == "auto" else bool(vectorize),
        found.channels_last if channels_last == "auto" else bool(channels_last),
        "table" if vectorize == "auto" else "config",
        "table" if channels_last == "auto" else "config",
        f"{model_kind}/{device_type}",
    )
