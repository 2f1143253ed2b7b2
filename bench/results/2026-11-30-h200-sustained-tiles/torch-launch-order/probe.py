# Which GEMM torch's backward launches first, from the operand strides in the kernel names.
import re, sys, torch
o = dict(dtype=torch.bfloat16, device="cuda")
out_dir = sys.argv[1]
for rows, k, n, g in [(8192, 7168, 2048, 32), (16384, 4096, 14336, 8)]:
    x = torch.randn(rows, k, **o, requires_grad=True); w = torch.randn(g, k, n, **o, requires_grad=True)
    dy = torch.randn(rows, n, **o); offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (rows // g)
    for _ in range(3):
        out = torch._grouped_mm(x, w, offs=offs); torch.autograd.grad(out, (x, w), grad_outputs=dy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = torch._grouped_mm(x, w, offs=offs); torch.autograd.grad(out, (x, w), grad_outputs=dy); torch.cuda.synchronize()
    ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
    print(rows, k, n, g)
    with open(f"{out_dir}/names-{rows}-{k}-{n}-{g}.txt", "w") as f:
        for e in ev:
            f.write(e.name + "\n\n")
            ms = (e.time_range.end - e.time_range.start) / 1e3
            if "GemmUniversal" in e.name:
                strides = re.findall(r"tuple<\s*(long|cute::C<1>|cute::_1)\s*,\s*(long|cute::C<1>|cute::_1)", e.name)
                print("  GEMM %.3f ms" % ms, strides[:3])
            else:
                print("  %-60s %.3f ms" % (e.name[:60], ms))
