"""``opacus.grad_sample.conv``: Opacus's names for the engine's convolution samplers
(``grad_samplers.conv``). ``convolution2d_backward_as_a_convolution`` (Opacus's second method for 2-D
convolutions) is the same sampler here: the engine has one exact method per layer."""

from grad_samplers.conv import conv_grad_sample as compute_conv_grad_sample
from grad_samplers.conv import conv_norm_sample as compute_conv_norm_sample

__all__ = ["compute_conv_grad_sample", "compute_conv_norm_sample", "convolution2d_backward_as_a_convolution"]

#: Opacus's alternative 2-D method; here the engine's one exact convolution sampler.
convolution2d_backward_as_a_convolution = compute_conv_grad_sample
