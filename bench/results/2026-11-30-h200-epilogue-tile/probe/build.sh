set -e
F="-O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I/work/main/.cutlass/include -I/work/main/csrc -I/work/main/csrc/include"
for f in coop coop128 pp main; do (/usr/local/cuda/bin/nvcc $F -c $f.cu -o $f.o > $f.log 2>&1; echo "$f rc $?") & 
  [ $f = coop128 ] && wait; done; wait
/usr/local/cuda/bin/nvcc -gencode arch=compute_90a,code=sm_90a main.o coop.o coop128.o pp.o /tmp/cuda-build/libnodrop_engine_cuda.a /tmp/cuda-build/libnodrop_engine_common.a -o epi_exp -lcudart_static
echo linked
