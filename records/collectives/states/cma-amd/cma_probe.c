// Single copy (process_vm_readv, what Open MPI's CMA uses) between two processes, each
// reading the other's buffer at the same time, as an all_reduce's exchange would: how
// fast a rank can take a peer's private bytes without staging them.
//   cc -O2 -o cma_probe cma_probe.c && ./cma_probe [MiB] [rounds]
// Parent pinned to CPU 0, child to CPU 1; both touch their buffer, swap addresses and
// pids through pipes, meet at a pipe barrier, then time one whole-buffer read each.
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

// Both sides write one byte and read one: neither passes until the other arrived.
static void meet(int out_fd, int in_fd) {
  char c = 0;
  if (write(out_fd, &c, 1) != 1 || read(in_fd, &c, 1) != 1) exit(2);
}

static void run(int me, int out_fd, int in_fd, size_t bytes, int rounds) {
  pin(me);
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // let the peer read us (Yama)
  char* mine = malloc(bytes);
  char* theirs = malloc(bytes);
  memset(mine, 1 + me, bytes);
  memset(theirs, 0, bytes);
  struct { pid_t pid; void* addr; } self = {getpid(), mine}, peer;
  if (write(out_fd, &self, sizeof self) != sizeof self) exit(2);
  if (read(in_fd, &peer, sizeof peer) != sizeof peer) exit(2);
  for (int r = 0; r < rounds; ++r) {
    meet(out_fd, in_fd);
    double t0 = now_s();
    struct iovec local = {theirs, bytes}, remote = {peer.addr, bytes};
    ssize_t got = process_vm_readv(peer.pid, &local, 1, &remote, 1, 0);
    double dt = now_s() - t0;
    if (got != (ssize_t)bytes) {
      perror("process_vm_readv");
      exit(3);
    }
    if (theirs[bytes - 1] != 2 - me) exit(4);  // the peer's bytes arrived
    printf("cpu %d round %d: %.2f ms, %.1f GB/s\n", me, r, dt * 1e3, bytes / dt / 1e9);
    fflush(stdout);
    meet(out_fd, in_fd);  // both done before the next round starts
  }
}

int main(int argc, char** argv) {
  size_t bytes = (size_t)(argc > 1 ? atoi(argv[1]) : 64) << 20;
  int rounds = argc > 2 ? atoi(argv[2]) : 8;
  int to_child[2], to_parent[2];
  if (pipe(to_child) || pipe(to_parent)) return 1;
  pid_t child = fork();
  if (child == 0) {
    run(1, to_parent[1], to_child[0], bytes, rounds);
    return 0;
  }
  run(0, to_child[1], to_parent[0], bytes, rounds);
  int status;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
