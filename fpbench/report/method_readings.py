"""fpbench's readings of each method where its paper and reference code leave a choice.

Paper-protocol data, keyed by the method's registry name, one line each: the paper protocols
(`benchmarks/papers/*.toml`) hold every feeding cell to them as the virtual config paths
`readings.<key>` (`fpbench.report.protocol`). A method writes none of this: its readings live
here, beside the protocols that check them. `official_check`: whether a differential test runs
the official code on the same inputs ("none" for a method not listed).
"""

from __future__ import annotations

# fpbench's CLIP prompt learners built on CoOp's model: each client's optimiser and lr schedule
# start anew every round, without warmup (the reference code of PromptFL and FedOTP keeps one,
# with Dassl's warmup: declared)
COOP = {"optimizer_state": "fresh-per-round"}
# the deep CLIP prompt learners (MaPLe, PLOT, PromptSRC): as fpbench's other CLIP methods,
# every prompt and coupling function averaged by FedAvg (FLiP's adaptation)
DEEP = {"optimizer_state": "fresh-per-round", "fl_aggregation": "fedavg-all"}
DIFFERENTIAL = {"official_check": "differential"}

READINGS: dict[str, dict[str, str]] = {
    "atpfl": {**COOP, "z": "class-text-features+image-features"},  # text prompt; visual prompt
    "bpl": {
        **COOP,
        **DIFFERENTIAL,  # trainers/vpt.py: tests/test_peer_bpl.py
        "mc_noise": "per-round-buffer",  # official: fresh torch.randn per forward (batch size 1)
        "batch": "per-sample",  # official: batch size 1 (its bias broadcast needs it)
        "fl_aggregation": "fedavg-all",
    },
    "cocoop": {**COOP, **DIFFERENTIAL},  # trainers/cocoop.py: tests/test_peer_clip_reference.py
    "coop-local": COOP,
    "dp-fpl": {
        **COOP,
        **DIFFERENTIAL,  # trainers/DP_FPL.py: tests/test_peer_clip_fl.py
        # the server's Gaussian on the mean global gradient is drawn by the clients,
        # N(0, std^2 / N) each (the same distribution)
        "global_noise": "client-drawn",
        # the official averages the global gradient after every step; the suites train a
        # round's batches and average the global prompts once per round
        "global_exchange": "per-round",
        "randomness": "per-run-client-round",
    },
    "fedclip": {
        **COOP,
        **DIFFERENTIAL,  # fedclip/methods/fed_at_clip.py: test_peer_clip_fl
        # a client's batch of one sample has zero contrastive loss; the official code skips it
        # (no optimiser step), fpbench steps (weight decay and momentum still move the adapter)
        "single_sample_batch": "zero-loss-step",
    },
    "fedmvp": {
        **COOP,  # the official client keeps its SGD momentum and cosine schedule across rounds
        **DIFFERENTIAL,  # model/FedMVP.py, federated/client.py: tests/test_peer_fedmvp.py
        # the official batch flip is a fair coin per step; fpbench takes its expectation
        "flip": "expected",
        # the official client switches to LoRA factors of the attention once its round's last
        # batch loss is below 0.5; fpbench's switch reads the round's mean training loss
        "lora_switch": "round-mean-loss",
        # the official client forwards every batch of a round and steps once, on the last
        "local_steps": "every-batch",
        "fl_aggregation": "uniform-mean",
    },
    "fedotp": {
        **COOP,
        **DIFFERENTIAL,  # trainers/GLP_OT.py: tests/test_peer_official.py
        "ot_stop": "per-problem",  # the official code: when the batch's mean change converges
        "ot_precision": "fp64",  # the official code: the model's dtype
    },
    "fedpgp": {
        **COOP,
        **DIFFERENTIAL,  # trainers/fedpgp.py: tests/test_peer_clip_fl.py
        # the script's NUM_PROMPT=2 (2C columns, a distractor copy): not reproduced, C-way scores
        "num_prompts": "1",
    },
    "fedpha": {
        **COOP,
        **DIFFERENTIAL,  # trainers/GL_SVDMSE.py: tests/test_peer_clip_fl_2025.py
        # one local prompt length for every client (the official HE variant varies it)
        "local_lengths": "uniform",
    },
    "fedpr": {
        # util/adam_svd.py (projector and projected Adam steps): tests/test_peer_official.py
        **DIFFERENTIAL,
        # torch's Adam adds eps after the bias correction; FedPR's AdamSVD before it
        "adam_eps": "after-bias-correction",
        # FedPR keeps each client's AdamSVD (moments, step count) across rounds
        "optimizer_state": "fresh-per-round",
    },
    "fedtpg": {
        **COOP,
        **DIFFERENTIAL,  # model/prompt_net.py, FedTPG.py: test_peer_clip_fl
        "generator_precision": "fp32",  # the official casts the generator to fp16
        # at evaluation the generator sees every class of the dataset; training: the client's
        "eval_class_set": "all",
    },
    "gpt-fl": COOP,
    "kgcoop": {
        **COOP,
        **DIFFERENTIAL,  # trainers/kgcoop.py: tests/test_peer_clip_reference.py
        "kg_distance": "code-cosine",  # the paper's eq. 5: squared L2 (distance = "squared-l2")
    },
    "maple": {
        **DEEP,
        **DIFFERENTIAL,  # trainers/maple.py: tests/test_peer_official_deep.py
        "precision": "fp32-prompts",  # the reference: fp16 CLIP and prompts
    },
    "pfedmoap": {
        **COOP,
        **DIFFERENTIAL,  # trainers/pfedmoap.py: tests/test_peer_clip_fl_2025.py
        # the official clients train one after another and see this round's earlier uploads
        "expert_uploads": "previous-rounds",
        # official: a first-time client of a later round keeps the previous client's experts
        "first_time_experts": "none",
        # official "nearest" fails (topk of a list) when more clients uploaded than experts
        "expert_selection": "nearest-l2",
        "gate_lr_schedule": "run-schedule",
        # official: a client trained this round is scored at once, with its training's experts
        "eval_experts": "after-round",
    },
    "plot": {
        **DEEP,
        **DIFFERENTIAL,  # plot-coop/trainers/plot.py: test_peer_official_deep
        "ot_stop": "per-problem",  # the reference: when the batch's mean change of u converges
        "ot_precision": "fp64",  # the reference: the model's dtype
    },
    "powder": {
        **COOP,
        "adaptation": "task-prompt-per-client",  # see the method's module docstring
        "generation": "positively-correlated-only",  # none correlated: the global prompt
    },
    "proda": {
        **COOP,
        "official_check": "none",  # no official code; FLiP's reimplementation not run
        "n_prompts": "fpbench-4",  # FLiP's --num_prompt 1 reduces ProDA to CoOp
        "prompt_batch": "all-prompts",  # the paper: a sampled mini-batch of prompts per step
        "covariance_divisor": "code-P+1",  # FLiP's divisor of the summed squared deviations
        "fl_aggregation": "fedavg-all",
    },
    "prograd": {
        **COOP,
        **DIFFERENTIAL,  # prograd.py + Dassl's step: test_peer_clip_reference
        "zero_kl_gradient": "no-projection",  # the official code divides by its zero norm
        "prompt_text": "official",  # "X..X <template words> name.": extra BPE tokens stay fixed
    },
    "promptfl": {**COOP, **DIFFERENTIAL},  # CoOp's trainers/coop.py: tests/test_peer_official.py
    "promptfolio": {
        **COOP,
        **DIFFERENTIAL,  # trainers/PromptFolio.py: tests/test_peer_clip_fl.py
        # each client's prompt with its own train size; the official code pairs them by the
        # position in the sampled order (equal under equal sizes)
        "aggregation_weights": "own-size",
    },
    "promptsrc": {
        **DEEP,
        **DIFFERENTIAL,  # trainers/promptsrc.py: tests/test_peer_official_deep.py
        "precision": "fp32-prompts",  # the reference: fp16 CLIP and prompts
        "gpa": "server-over-rounds",  # the reference: over the epochs of one centralised run
    },
    "sdfed": {
        **COOP,
        "d": "normalised-class-text-features",  # averaged over the classes in the losses
        "projector_every": "local-step",  # Algorithm 1 (sec. 4.2.5 says once per round)
    },
    "sgpt": DIFFERENTIAL,  # models/vit_models_pr.py: tests/test_peer_official.py
    "tpfl": COOP,
    "uopp": {
        **COOP,
        "adaptation": "one-prompt-pooled-prototypes",  # see the method's module docstring
        "dual_head_confidence": "calibrated",  # max softmax of the standardised logits
    },
    "zero-shot": {
        **COOP,
        **DIFFERENTIAL,  # zsclip.py: tests/test_peer_clip_reference.py
        "template_without_coop_entry": "a photo of a {}.",
    },
}


def method_readings(method: str) -> dict[str, str]:
    """The readings of the method registered as `method` (`official_check` "none" unless set)."""
    return {"official_check": "none", **READINGS.get(method, {})}
