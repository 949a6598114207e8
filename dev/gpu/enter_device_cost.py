# Host cost of cuda_driver.enter_device where the current context is already the device's primary one (every launch pays it).
import timeit, torch
from fagen import cuda_driver as driver
torch.zeros(1, device="cuda")
driver.enter_device(0)
n = 200000
t = min(timeit.repeat(lambda: driver.enter_device(0), number=n, repeat=5)) / n * 1e6
print(f"enter_device(current primary): {t:.3f} us")
