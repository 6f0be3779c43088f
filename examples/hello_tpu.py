"""The user guide's first check: a 2x2 product on the tpu device (XLA:CPU when no TPU is present).

No `import torch_tpu`: installing the wheel is enough, `import torch` loads the backend.
"""

import torch

x = torch.randn(2, 2, device="tpu")
y = torch.randn(2, 2, device="tpu")
z = x @ y
print(z)
print(z.device)

# The same product computed by CPU PyTorch from the same inputs, moved back.
expected = x.cpu() @ y.cpu()
torch.testing.assert_close(z.cpu(), expected)
print(f"matches the CPU product; running on {torch.tpu.get_device_name()}")
