// The least an all_reduce of private buffers must do between two cores, and nothing
// else: each process streams its whole source (in DRAM) through shared slots to the
// other, which copies every chunk out, both directions at once. No reduction, no output
// beyond the copy-out, so its rate bounds the hand-off of pycomm's pair exchange.
//   cc -O2 -o exchange_probe exchange_probe.c && ./exchange_probe [MiB] [rounds] [slot KiB] [slots]
// Parent on CPU 0, child on CPU 1; one thread each alternates sending and receiving, as
// pycomm's all_reduce_pair does; a slot's flag counts its uses (odd: full).
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  _Alignas(64) atomic_uint_fast64_t uses;
} Flag;

static size_t slot_bytes, nslots;
static char* area;   // [direction][slot] payloads
static Flag* flags;  // [direction][slot]
static atomic_int* gate;  // round barrier: both add 1, wait for 2 * (round + 1)

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

static char* slot(int dir, size_t s) { return area + (dir * nslots + s) * slot_bytes; }
static Flag* flag(int dir, size_t s) { return &flags[dir * nslots + s]; }

// Sends src to the peer (direction me) and receives the peer's into dst (direction 1-me).
static void exchange(int me, const char* src, char* dst, size_t bytes, uint64_t round) {
  size_t chunks = bytes / slot_bytes, sent = 0, got = 0;
  while (got < chunks) {
    size_t r = got % nslots;  // receive: slot full for this pass?
    uint64_t want = 2 * (round * ((chunks + nslots - 1) / nslots) + got / nslots) + 1;
    if (atomic_load_explicit(&flag(1 - me, r)->uses, memory_order_acquire) == want) {
      memcpy(dst + got * slot_bytes, slot(1 - me, r), slot_bytes);
      atomic_store_explicit(&flag(1 - me, r)->uses, want + 1, memory_order_release);
      ++got;
      continue;
    }
    if (sent < chunks) {  // send: slot free for this pass?
      size_t s = sent % nslots;
      uint64_t free_at = 2 * (round * ((chunks + nslots - 1) / nslots) + sent / nslots);
      if (atomic_load_explicit(&flag(me, s)->uses, memory_order_acquire) == free_at) {
        memcpy(slot(me, s), src + sent * slot_bytes, slot_bytes);
        atomic_store_explicit(&flag(me, s)->uses, free_at + 1, memory_order_release);
        ++sent;
        continue;
      }
    }
    __builtin_ia32_pause();
  }
  while (sent < chunks) {  // the peer took ours as fast as we took theirs: finish sending
    size_t s = sent % nslots;
    uint64_t free_at = 2 * (round * ((chunks + nslots - 1) / nslots) + sent / nslots);
    while (atomic_load_explicit(&flag(me, s)->uses, memory_order_acquire) != free_at)
      __builtin_ia32_pause();
    memcpy(slot(me, s), src + sent * slot_bytes, slot_bytes);
    atomic_store_explicit(&flag(me, s)->uses, free_at + 1, memory_order_release);
    ++sent;
  }
}

static void meet(int round) {
  atomic_fetch_add(gate, 1);
  while (atomic_load(gate) < 2 * (round + 1)) __builtin_ia32_pause();
}

static void run(int me, size_t bytes, int rounds) {
  pin(me);
  char* src = malloc(bytes);
  char* dst = malloc(bytes);
  memset(src, 1 + me, bytes);
  memset(dst, 0, bytes);
  for (int r = 0; r < rounds; ++r) {
    meet(r);
    double t0 = now_s();
    exchange(me, src, dst, bytes, (uint64_t)r);
    double dt = now_s() - t0;
    if (dst[0] != 2 - me || dst[bytes - 1] != 2 - me) exit(4);
    printf("cpu %d round %d: %.2f ms, %.1f GB/s each way\n", me, r, dt * 1e3, bytes / dt / 1e9);
    fflush(stdout);
  }
}

int main(int argc, char** argv) {
  size_t bytes = (size_t)(argc > 1 ? atoi(argv[1]) : 64) << 20;
  int rounds = argc > 2 ? atoi(argv[2]) : 8;
  slot_bytes = (size_t)(argc > 3 ? atoi(argv[3]) : 256) << 10;
  nslots = argc > 4 ? (size_t)atoi(argv[4]) : 4;
  if (bytes % (slot_bytes * nslots) != 0) {
    fprintf(stderr, "size must be a multiple of slots x slot size\n");
    return 1;
  }
  size_t shared = 2 * nslots * slot_bytes + 2 * nslots * sizeof(Flag) + 64;
  char* m = mmap(NULL, shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return 1;
  area = m;
  flags = (Flag*)(m + 2 * nslots * slot_bytes);
  gate = (atomic_int*)(flags + 2 * nslots);
  pid_t child = fork();
  if (child == 0) {
    run(1, bytes, rounds);
    return 0;
  }
  run(0, bytes, rounds);
  int status;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
