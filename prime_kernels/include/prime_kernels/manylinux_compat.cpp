// Linked into every extension so that it loads on glibc 2.28 (the manylinux_2_28 wheels)
// whatever glibc the build machine has: libstdc++'s headers read glibc's
// __libc_single_threaded (glibc >= 2.32) when the build machine's glibc declares it, to
// skip atomic reference counts in single-threaded programs. Defined here, hidden, the
// references bind to this copy instead of glibc's; 0 means "not known to be
// single-threaded", so reference counts stay atomic, which torch (a multi-threaded
// process) needs anyway.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}
