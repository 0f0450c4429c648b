"""Probe torch_memory_saver on this machine: allocate in tagged regions, pause, measure from
another process, resume, check contents and a CUDA graph replay. Prints one line per check."""
import subprocess, sys, time
import torch
from torch_memory_saver import torch_memory_saver as tms

tms.hook_mode = "torch"

def free_gib_elsewhere():
    out = subprocess.run([sys.executable, "-c", "import torch; f,t=torch.cuda.mem_get_info(); print(f)"],
                         capture_output=True, text=True).stdout
    return int(out.strip()) / 2**30

print("free before", round(free_gib_elsewhere(), 2))
with tms.region(tag="weights", enable_cpu_backup=True):
    w = torch.full((1 << 30,), 3, dtype=torch.bfloat16, device="cuda")  # 2 GiB
with tms.region(tag="kv_cache"):
    kv = torch.zeros((4 << 30,), dtype=torch.bfloat16, device="cuda")  # 8 GiB
torch.cuda.synchronize()
print("free after alloc", round(free_gib_elsewhere(), 2))
x = torch.ones(1024, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y = w[:1024].float() + x
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    y = w[:1024].float() + x
t = time.perf_counter(); torch.cuda.synchronize(); tms.pause("kv_cache"); tms.pause("weights"); torch.cuda.synchronize()
print("pause s", round(time.perf_counter() - t, 3), "free after pause", round(free_gib_elsewhere(), 2))
t = time.perf_counter(); tms.resume("weights"); tms.resume("kv_cache"); torch.cuda.synchronize()
print("resume s", round(time.perf_counter() - t, 3), "free after resume", round(free_gib_elsewhere(), 2))
print("weights restored", bool((w[:4096] == 3).all().item()), "kv zero?", float(kv[:10].float().abs().sum()))
g.replay(); torch.cuda.synchronize()
print("graph replay after resume ok", bool((y == 4).all().item()))
