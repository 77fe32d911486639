# cython: language_level=3
"""The instruction-set features of this CPU, as the kernels' dispatcher needs them.

Compiled with no ``-march`` at all, never a variant's, so that importing it is safe on any CPU
of its architecture; ``rudra_zmq.kernels.variants`` turns the features into the variants this
CPU can run, and ``rudra_zmq.kernels`` imports the best of them. Reads ``cpuid`` and, for the
AVX and AVX-512 register state the operating system saves, ``xgetbv``: a CPU with AVX-512 under
an OS (or hypervisor) that does not save the ZMM registers cannot run AVX-512 code.
"""

cdef extern from *:
    """
    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    #include <cpuid.h>
    #define RZ_X86 1
    /* cpuid leaf, register and bit of each feature the x86-64-v2/v3/v4 levels require
       (Intel SDM vol. 2A, CPUID; AMD APM vol. 3, appendix E) */
    enum { RZ_L1_ECX, RZ_L7_EBX, RZ_LX1_ECX };
    static const struct { const char *name; int reg; int bit; } rz_bits[] = {
        {"sse3", RZ_L1_ECX, 0}, {"ssse3", RZ_L1_ECX, 9}, {"fma", RZ_L1_ECX, 12},
        {"cx16", RZ_L1_ECX, 13}, {"sse4_1", RZ_L1_ECX, 19}, {"sse4_2", RZ_L1_ECX, 20},
        {"movbe", RZ_L1_ECX, 22}, {"popcnt", RZ_L1_ECX, 23}, {"avx", RZ_L1_ECX, 28},
        {"f16c", RZ_L1_ECX, 29},
        {"bmi1", RZ_L7_EBX, 3}, {"avx2", RZ_L7_EBX, 5}, {"bmi2", RZ_L7_EBX, 8},
        {"avx512f", RZ_L7_EBX, 16}, {"avx512dq", RZ_L7_EBX, 17}, {"avx512cd", RZ_L7_EBX, 28},
        {"avx512bw", RZ_L7_EBX, 30}, {"avx512vl", RZ_L7_EBX, 31},
        {"lahf_lm", RZ_LX1_ECX, 0}, {"lzcnt", RZ_LX1_ECX, 5},
    };
    #define RZ_NBITS ((int)(sizeof(rz_bits) / sizeof(rz_bits[0])))
    static const char *rz_bit_name(int i) { return rz_bits[i].name; }

    /* regs[0..2]: leaf 1 ECX, leaf 7 EBX, leaf 0x80000001 ECX; returns 0 without cpuid 1 */
    static int rz_cpuid_regs(unsigned int regs[3], unsigned long long *xcr0) {
        unsigned int a, b, c, d;
        regs[0] = regs[1] = regs[2] = 0;
        *xcr0 = 0;
        if (!__get_cpuid(1, &a, &b, &c, &d))
            return 0;
        regs[0] = c;
        if (c & (1u << 27)) {  /* OSXSAVE: the OS uses XSAVE, so XCR0 can be read */
            unsigned int lo, hi;
            __asm__ volatile ("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            *xcr0 = ((unsigned long long)hi << 32) | lo;
        }
        if (__get_cpuid_max(0, 0) >= 7) {
            __cpuid_count(7, 0, a, b, c, d);
            regs[1] = b;
        }
        if (__get_cpuid(0x80000001u, &a, &b, &c, &d))
            regs[2] = c;
        return 1;
    }
    static int rz_bit_set(const unsigned int regs[3], int i) {
        return (regs[rz_bits[i].reg] >> rz_bits[i].bit) & 1u;
    }
    #else
    #define RZ_X86 0
    #define RZ_NBITS 0
    static const char *rz_bit_name(int i) { (void)i; return ""; }
    static int rz_cpuid_regs(unsigned int regs[3], unsigned long long *xcr0) {
        regs[0] = regs[1] = regs[2] = 0; *xcr0 = 0; return 0;
    }
    static int rz_bit_set(const unsigned int regs[3], int i) { (void)regs; (void)i; return 0; }
    #endif
    """
    int RZ_X86
    int RZ_NBITS
    const char *rz_bit_name(int i)
    int rz_cpuid_regs(unsigned int regs[3], unsigned long long *xcr0)
    int rz_bit_set(const unsigned int regs[3], int i)


def x86_features():
    """The x86 features this CPU reports and the OS lets code use, as a set of names
    (``"avx2"``, ``"f16c"``, ``"avx512f"``, ...; ``"os_avx"`` and ``"os_avx512"`` when the OS
    saves the YMM, and the opmask and ZMM, registers). Empty on other architectures, or when
    this module was built by a compiler without GCC's ``<cpuid.h>``. Does not block."""
    cdef unsigned int regs[3]
    cdef unsigned long long xcr0
    cdef int i
    if not RZ_X86 or not rz_cpuid_regs(regs, &xcr0):
        return frozenset()
    found = {rz_bit_name(i).decode() for i in range(RZ_NBITS) if rz_bit_set(regs, i)}
    if xcr0 & 0x6 == 0x6:  # XMM and YMM state
        found.add("os_avx")
    if xcr0 & 0xE6 == 0xE6:  # and opmask, ZMM_Hi256, Hi16_ZMM
        found.add("os_avx512")
    return frozenset(found)
