import pytest

from bitserve.diffusion.params import GenerationParams, InvalidParams, parse_label
from bitserve.diffusion.schedule import Schedule


def test_timesteps_trail_from_pure_noise():
    s = Schedule()
    assert s.timesteps(1000) == list(range(999, -1, -1))
    steps = s.timesteps(30)
    assert len(steps) == 30 and steps[0] == 999 and steps == sorted(steps, reverse=True)
    assert len(set(steps)) == 30 and steps[-1] >= 0
    with pytest.raises(ValueError, match=r"steps must be in 1\.\.1000"):
        s.timesteps(0)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (GenerationParams(label=10), "label"),
        (GenerationParams(label=-2), "label"),
        (GenerationParams(label=1, steps=0), "steps"),
        (GenerationParams(label=1, steps=1001), "steps"),
        (GenerationParams(label=1, guidance_scale=-0.5), "guidance_scale"),
        (GenerationParams(label=1, guidance_scale=float("nan")), "guidance_scale"),
        (GenerationParams(label=1, seed=-1), "seed"),
        (GenerationParams(label=1, eta=1.5), "eta"),
    ],
)
def test_bad_params_name_their_field(params, field):
    with pytest.raises(InvalidParams, match=f"field '{field}'"):
        params.check()


def test_halves_follow_the_guidance_formula():
    # eps = eps_u + s (eps_c - eps_u): s = 1 is eps_c alone, s = 0 eps_u alone
    assert GenerationParams(label=3, guidance_scale=1.0).halves == (True, False)
    assert GenerationParams(label=3, guidance_scale=0.0).halves == (False, True)
    assert GenerationParams(label=None, guidance_scale=5.0).halves == (False, True)
    assert GenerationParams(label=3, guidance_scale=3.0).halves == (True, True)
    assert GenerationParams(label=3, guidance_scale=0.5).halves == (True, True)


@pytest.mark.parametrize(
    ("prompt", "label"),
    [("7", 7), ("seven", 7), ("A Seven.", 7), ("digit 0", 0), ("the number nine", 9),
     ("none", None), ("", None)],
)  # fmt: skip
def test_prompt_to_label(prompt, label):
    assert parse_label(prompt) == label


@pytest.mark.parametrize("prompt", ["eleven", "12", "a cat", 7])
def test_prompt_that_is_not_a_digit(prompt):
    with pytest.raises(InvalidParams, match="field 'prompt'"):
        parse_label(prompt)
