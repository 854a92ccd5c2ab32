"""Diffusion serving: a denoiser (unet.py), its noise schedule (schedule.py), DDIM/DDPM
updates with classifier-free guidance (sampler.py), step-level batching of many
requests' denoising steps (engine.py), and the evaluation `bitserve eval` runs
(evaluate.py) with a judge classifier (judge.py)."""
