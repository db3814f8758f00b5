"""Each preset's paper, as ``python -m cluster presets`` lists it."""

PAPERS = {
    "fedavg": "McMahan et al. 2017, Communication-Efficient Learning of Deep Networks",
    "fedsam": "Qu et al. 2022, Generalized Federated Learning via Sharpness Aware Minimization",
    "scaffold": "Karimireddy et al. 2020, SCAFFOLD: Stochastic Controlled Averaging",
    "dp_fedavg": "McMahan et al. 2018, Learning Differentially Private Recurrent LMs",
    "dp_fedsam": "Shi et al. 2023, Make Landscape Flatter in DP Federated Learning",
    "dp_fedsam_topk": "Shi et al. 2023 (DP-FedSAM-top-k)",
    "fed_smp_topk": "Hu et al. 2022, Federated Learning with Sparsified Model Perturbation",
    "fed_smp_randk": "Hu et al. 2022 (Fed-SMP rand-k)",
    "dp_fedavg_blur": "Cheng et al. 2022, DP Federated Learning with Local Regularization (BLUR)",
    "dp_fedavg_lus": "Cheng et al. 2022 (LUS: local update sparsification)",
    "dp_fedavg_blurs": "Cheng et al. 2022 (BLUR + LUS)",
    "dp_fedpgn": "Liu et al. 2025, DP-FedPGN",
    "dp_fedpgn_ls": "Liu et al. 2025, DP-FedPGN with Laplacian smoothing",
    "dp_fedavg_ls": "Liang et al. 2024, DP-FedAvg with Laplacian smoothing",
    "dp_fedavg_sample": "Noble et al. 2022, DP Federated Learning on Heterogeneous Data (Alg. 2)",
    "dp_scaffold": "Noble et al. 2022, DP-SCAFFOLD (Alg. 1)",
    "fetchsgd": "Rothchild et al. 2020, FetchSGD: Communication-Efficient FL with Sketching",
    "dpsfl": "Zhang et al., DP Federated Learning with Sketching (DPSFL)",
    "dpsfl_ac": "Zhang et al., DPSFL with adaptive clipping (Andrew et al. 2021)",
}
