// Optional cross-check of tests/fixtures/ggml_blocks/ against llama.cpp's own
// compiled C (not needed by the tests): quantize_row_q4_0_ref /
// quantize_row_q8_0_ref must give q4_0.quant.bin / q8_0.quant.bin, and
// dequantize_row_* must give the gguf-py dequantized floats bit for bit.
//
// Build against a peer build of llama.cpp (scripts/build_llama_cpp.sh; the
// static libggml-base.a of its CMake build tree):
//   g++ -x c tools/reference/ggml_blocks_check.c -x none -o /tmp/ggml_blocks_check \
//       BUILD/ggml/src/libggml-base.a -lm -lpthread -fopenmp
//   /tmp/ggml_blocks_check tests/fixtures/ggml_blocks
// Exits non-zero on any difference. Checked 2026-12-02 with commit 0c1e570
// (llama-cpp-python 0.3.36), -DGGML_NATIVE=ON: all identical.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
void quantize_row_q4_0_ref(const float * x, void * y, int64_t k);
void quantize_row_q8_0_ref(const float * x, void * y, int64_t k);
void dequantize_row_q4_0(const void * x, float * y, int64_t k);
void dequantize_row_q8_0(const void * x, float * y, int64_t k);
void dequantize_row_q4_K(const void * x, float * y, int64_t k);
void dequantize_row_q5_K(const void * x, float * y, int64_t k);
void dequantize_row_q6_K(const void * x, float * y, int64_t k);
static void * rd(const char * p, size_t * n) { FILE * f = fopen(p, "rb"); if (!f) { perror(p); exit(2); } fseek(f, 0, SEEK_END); *n = ftell(f); fseek(f, 0, SEEK_SET); void * b = malloc(*n); fread(b, 1, *n, f); fclose(f); return b; }
int main(int argc, char ** argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s FIXTURE_DIR\n", argv[0]); return 2; }
  int bad = 0;
  const char * d = argv[1]; char p[512]; size_t n, m;
  snprintf(p, 512, "%s/values.f32.bin", d); float * v = rd(p, &n); int64_t k = n / 4;
  uint8_t out[8192];
  snprintf(p, 512, "%s/q4_0.quant.bin", d); uint8_t * q = rd(p, &m);
  quantize_row_q4_0_ref(v, out, k); printf("q4_0 quant %s\n", memcmp(out, q, m) ? (bad = 1, "DIFF") : "same");
  snprintf(p, 512, "%s/q8_0.quant.bin", d); q = rd(p, &m);
  quantize_row_q8_0_ref(v, out, k); printf("q8_0 quant %s\n", memcmp(out, q, m) ? (bad = 1, "DIFF") : "same");
  const char * names[5] = {"q4_0", "q8_0", "q4_k", "q5_k", "q6_k"};
  void (*fs[5])(const void *, float *, int64_t) = {dequantize_row_q4_0, dequantize_row_q8_0, dequantize_row_q4_K, dequantize_row_q5_K, dequantize_row_q6_K};
  for (int i = 0; i < 5; i++) {
    snprintf(p, 512, "%s/%s.blocks.bin", d, names[i]); uint8_t * b = rd(p, &m);
    snprintf(p, 512, "%s/%s.dequant.f32.bin", d, names[i]); float * e = rd(p, &n);
    float y[2048]; fs[i](b, y, 2048);
    int diff = 0; for (int j = 0; j < 2048; j++) if (memcmp(&y[j], &e[j], 4)) diff++;
    printf("%s dequant: %d of 2048 differ from gguf-py\n", names[i], diff);
    if (diff) bad = 1;
  }
  return bad;
}
