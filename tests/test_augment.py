"""Preprocessing and batched augmentation match their per-image definitions."""

import pytest
import torch

from datasets.augment import Augment, Preprocess
from datasets.tasks import TASKS


def test_random_crop_equals_torchvision_style_crop_of_the_padded_image():
    x = torch.arange(2 * 3 * 5 * 5, dtype=torch.float32).view(2, 3, 5, 5)
    aug = Augment(padding=2)
    out = aug(x, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    dy = torch.randint(0, 5, (2,), generator=g)
    dx = torch.randint(0, 5, (2,), generator=g)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(2):
        expected = padded[b, :, dy[b] : dy[b] + 5, dx[b] : dx[b] + 5]
        assert torch.equal(out[b], expected)


def test_a_crop_pads_black_pixels_in_the_normalised_space():
    """torchvision's RandomCrop pads the pixels with 0 before Normalize: after normalising,
    the padding is (0 − mean)/std of each channel, not 0."""
    stats = Preprocess(mean=(0.25, 0.5, 0.75), std=(0.5, 0.25, 0.125))
    pixels = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    out = Augment(padding=2, pixel_stats=stats)(stats(pixels), torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    dy, dx = torch.randint(0, 5, (4,), generator=g), torch.randint(0, 5, (4,), generator=g)
    framed = stats(torch.nn.functional.pad(pixels, (2, 2, 2, 2)))  # black pixels, normalised
    for b in range(4):
        assert torch.equal(out[b], framed[b, :, dy[b] : dy[b] + 5, dx[b] : dx[b] + 5])
    assert (out == 0).sum() < (out == -0.5).sum()  # black is −mean/std = −0.5 in channel 0


def test_feature_rows_skip_the_pixel_statistics_in_their_crops_too():
    """Rows stored as floats (standardised features) are not normalised pixels: their crops
    pad with 0, as before black padding, not with the task's normalised black (≈ −2)."""
    task = TASKS["cifar10_resnet18"]
    assert task.augment_for("uint8") is task.augment
    assert task.augment.pixel_stats == task.preprocess
    features = task.augment_for("float32")
    assert features.pixel_stats is None and features.padding == task.augment.padding
    rows = torch.rand(8, 3, 4, 4) + 1.0  # no zero inside
    out = features(rows, torch.Generator().manual_seed(0))
    assert set(out[out < 1.0].tolist()) <= {0.0}


def test_dpfedsam_emnist_input_is_the_authors_32_crop_of_the_image_padded_by_4():
    """DP-FedSAM's EMNIST code: RandomCrop(32, padding=4) of the 28×28 image, unnormalised; the
    model sees 32×32 (903,614 parameters, spec ≈ 0.90M) and the evaluation the centred frame."""
    task = TASKS["emnist_cnn_crop_flips"]
    pixels = torch.randint(0, 256, (6, 1, 28, 28), dtype=torch.uint8)
    framed = task.preprocess(pixels)
    assert framed.shape == (6, 1, 32, 32) and task.preprocess.shape((1, 28, 28)) == (1, 32, 32)
    assert torch.equal(framed[:, :, 2:30, 2:30], pixels.float() / 255)
    assert sum(p.numel() for p in task.model((1, 28, 28), 62).parameters()) == 903_614
    crop = Augment(padding=task.augment.padding)  # the crop alone, as the authors' first step
    out = crop(framed, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    dy, dx = torch.randint(0, 5, (6,), generator=g), torch.randint(0, 5, (6,), generator=g)
    padded_by_4 = torch.nn.functional.pad(pixels.float() / 255, (4, 4, 4, 4))
    for b in range(6):
        assert torch.equal(out[b], padded_by_4[b, :, dy[b] : dy[b] + 32, dx[b] : dx[b] + 32])


def test_flip_is_per_sample_and_seeded():
    x = torch.randn(64, 1, 4, 4)
    out = Augment(flip=True)(x, torch.Generator().manual_seed(1))
    flipped = [torch.equal(out[i], x[i].flip(2)) for i in range(64)]
    kept = [torch.equal(out[i], x[i]) for i in range(64)]
    assert all(f or k for f, k in zip(flipped, kept, strict=True))
    assert 16 < sum(flipped) < 48
    again = Augment(flip=True)(x, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)


def test_preprocess_scales_inverts_and_normalises():
    x = torch.tensor([[[[0, 255]]]], dtype=torch.uint8)
    assert torch.equal(Preprocess()(x), torch.tensor([[[[0.0, 1.0]]]]))
    assert torch.equal(Preprocess(invert=True)(x), torch.tensor([[[[1.0, 0.0]]]]))
    out = Preprocess(mean=(0.5,), std=(0.25,))(x)
    assert torch.allclose(out, torch.tensor([[[[-2.0, 2.0]]]]))
    features = torch.randn(3, 4)
    assert torch.equal(Preprocess()(features), features)


def test_preprocess_leaves_float_rows_as_they_are_even_with_image_stats():
    """Standardised or PCA features are stored as float32: the task's pixel stats must not
    shift them again."""
    rows = torch.randn(3, 1, 2, 2)
    assert torch.equal(Preprocess(mean=(0.5,), std=(0.25,))(rows), rows)


def test_vertical_flip_is_per_sample_seeded_and_draws_after_the_horizontal_one():
    x = torch.randn(64, 1, 4, 4)
    out = Augment(vertical_flip=True)(x, torch.Generator().manual_seed(2))
    flipped = [torch.equal(out[i], x[i].flip(1)) for i in range(64)]
    assert all(f or torch.equal(out[i], x[i]) for i, f in enumerate(flipped))
    assert 16 < sum(flipped) < 48
    assert torch.equal(out, Augment(vertical_flip=True)(x, torch.Generator().manual_seed(2)))
    both = Augment(flip=True, vertical_flip=True)(x, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    horizontal, vertical = torch.rand(64, generator=g) < 0.5, torch.rand(64, generator=g) < 0.5
    for i in range(64):
        expected = x[i].flip(2) if horizontal[i] else x[i]
        assert torch.equal(both[i], expected.flip(1) if vertical[i] else expected)


def test_grayscale_is_the_luminance_of_the_pixels_in_the_normalised_space():
    raw = torch.tensor([0.2, 0.6, 1.0]).view(1, 3, 1, 1).repeat(2, 1, 2, 2)
    stats = Preprocess(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    normalised = (raw - torch.tensor(stats.mean).view(1, 3, 1, 1)) / torch.tensor(stats.std).view(
        1, 3, 1, 1
    )
    out = Augment(grayscale=1.0, pixel_stats=stats)(normalised, torch.Generator().manual_seed(0))
    gray = 0.299 * 0.2 + 0.587 * 0.6 + 0.114 * 1.0
    expected = (gray - torch.tensor(stats.mean)) / torch.tensor(stats.std)
    assert torch.allclose(out, expected.view(1, 3, 1, 1).expand_as(out), atol=1e-6)
    assert torch.equal(Augment(grayscale=0.0)(normalised, torch.Generator()), normalised)


def test_grayscale_hits_about_its_probability_of_samples_reproducibly():
    x = torch.rand(400, 3, 2, 2)
    aug = Augment(grayscale=0.1)
    out = aug(x, torch.Generator().manual_seed(5))
    gray = (out[:, 0] == out[:, 1]).all(dim=(1, 2)) & (out[:, 1] == out[:, 2]).all(dim=(1, 2))
    assert 20 <= int(gray.sum()) <= 60  # 40 expected
    assert torch.equal(out, aug(x, torch.Generator().manual_seed(5)))
    assert torch.equal(out[~gray], x[~gray])


def test_grayscale_needs_rgb_and_a_probability():
    with pytest.raises(ValueError, match="RGB"):
        Augment(grayscale=1.0)(torch.rand(2, 1, 2, 2), torch.Generator())
    with pytest.raises(ValueError, match="probability"):
        Augment(grayscale=1.5)


def test_dpfedsam_tasks_carry_the_authors_augmentation():
    cifar = TASKS["cifar10_resnet18_flips_gray"].augment
    assert (cifar.padding, cifar.flip, cifar.vertical_flip, cifar.grayscale) == (4, True, True, 0.1)
    assert cifar.pixel_stats == TASKS["cifar10_resnet18"].preprocess
    emnist = TASKS["emnist_cnn_crop_flips"].augment
    assert (emnist.padding, emnist.flip, emnist.vertical_flip, emnist.grayscale) == (
        2,
        True,
        True,
        0,
    )
