"""Two models for CIFAR-10 (32x32 images, 10 classes).

    model = build_model("fastnet", width=16)   # small and quick: CPU runs, speed runs (width=64)
    model = build_model("resnet18")            # the classic, 11M parameters: GPU throughput runs
"""
import torch
from torch import nn


def resnet18(num_classes=10):
    """torchvision's ResNet-18 with the usual CIFAR stem.

    The ImageNet stem (7x7 stride-2 conv, then max-pool) shrinks 224-pixel images 4x at
    once; on 32-pixel images it would throw away most of the picture, so the first conv
    becomes 3x3 with stride 1 and the max-pool goes.
    """
    import torchvision  # here, not at the top: it takes about a second to import, and only ResNet-18 needs it

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision does
    model.maxpool = nn.Identity()
    return model


def conv_bn(c_in, c_out, pool=False):
    """3x3 conv -> (2x2 max-pool) -> BatchNorm -> GELU. Pooling before the norm quarters its work.

    BatchNorm's running statistics (used at test time) move 4x faster than PyTorch's default
    (momentum 0.4, not 0.1): runs of a few hundred steps end with statistics that fit the weights.
    """
    layers = [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    layers += [nn.BatchNorm2d(c_out, momentum=0.4), nn.GELU()]
    return layers


class FastNet(nn.Sequential):
    """A small, fast convnet in the spirit of airbench's (github.com/KellerJordan/cifar10-airbench).

    stem, then three blocks of (conv, pool, conv) at 16, 8 and 4 pixels, then a global
    max-pool and a linear layer. Block widths are width, 4*width, 4*width:
    width=64 has 2.0M parameters (GPU speed runs); width=16 has 0.13M (CPU runs).
    The stem is a 3x3 conv block, or with whiten=True a fixed 2x2 whitening filter bank
    (set from the data by `whiten_from`). identity_init=True starts each 3x3 conv as the
    identity on its first channels (the rest random), so early on signals pass straight through.
    bn_weights=False freezes BatchNorm's scales at 1 (only its shifts learn): the conv before it
    already sets the scale, and one fewer knob trains faster in short runs (as airbench does).
    Logits are scaled down (x 1/9, as airbench does) so that early training is not dominated
    by over-confident outputs.
    """

    def __init__(self, width=64, num_classes=10, logit_scale=1 / 9, whiten=False, identity_init=False,
                 bn_weights=True):
        widths = (width, 4 * width, 4 * width)
        if whiten:  # 12 whitening filters of 2x2x3 pixels and their negatives (GELU keeps both signs)
            stem = nn.Conv2d(3, 24, kernel_size=2, padding=0, bias=True)
            stem.weight.requires_grad = False
            layers, c_in = [stem, nn.GELU()], 24
        else:
            c_in = max(width // 2, 8)
            layers = conv_bn(3, c_in)
        for c_out in widths:
            layers += conv_bn(c_in, c_out, pool=True) + conv_bn(c_out, c_out)
            c_in = c_out
        layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes, bias=False)]
        super().__init__(*layers)
        self.logit_scale = logit_scale
        self.whiten = whiten
        if identity_init:  # the first c_in filters of each 3x3 conv pass their input through
            for conv in self.modules():
                if isinstance(conv, nn.Conv2d) and conv.kernel_size == (3, 3):
                    nn.init.dirac_(conv.weight.data[:min(conv.in_channels, conv.out_channels)])
        for norm in self.modules():
            if isinstance(norm, nn.BatchNorm2d):
                norm.weight.requires_grad = bn_weights

    def forward(self, x):
        return super().forward(x) * self.logit_scale

    @torch.no_grad()
    def whiten_from(self, images, eps=5e-4):
        """Set the whitening stem from (normalised) training images: its filters project each
        2x2 patch onto the principal directions of all patches, scaled to unit variance, so
        the next layer sees decorrelated inputs from the first step on."""
        stem = self[0]
        c, k = images.shape[1], stem.kernel_size[0]
        patches = images.float().unfold(2, k, 1).unfold(3, k, 1)          # (N, C, H', W', k, k)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k)
        covariance = patches.T @ patches / len(patches)
        variances, directions = torch.linalg.eigh(covariance)             # ascending variances
        filters = (directions.T / (variances + eps).sqrt()[:, None]).reshape(-1, c, k, k)
        stem.weight.copy_(torch.cat([filters, -filters]).to(stem.weight))


MODELS = {"fastnet": FastNet, "resnet18": resnet18}


def build_model(name, width=64, num_classes=10, whiten=False, identity_init=False, bn_weights=True):
    """A model by name: "fastnet" (uses `width`, `whiten`, `identity_init`, `bn_weights`) or "resnet18"."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    if name == "fastnet":
        return FastNet(width, num_classes, whiten=whiten, identity_init=identity_init, bn_weights=bn_weights)
    return MODELS[name](num_classes)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())
