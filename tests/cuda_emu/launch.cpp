// The entry point of an emulated kernel library: every kernel the library's other translation
// units registered (emu::Register), launched by name.
#include "cuda_emu.h"

// Runs kernel `name` over grid × block with `args` (a pointer to each argument's bytes, `sizes`
// their sizes, checked against the kernel's parameters). 0, or 1 with what went wrong in `err`.
extern "C" int emu_launch(const char* name, const unsigned* grid, const unsigned* block, void** args, int nargs,
                          const unsigned long long* sizes, char* err, unsigned long long errlen) {
    auto fail = [&](const std::string& m) {
        std::snprintf(err, errlen, "%s: %s", name, m.c_str());
        return 1;
    };
    auto it = emu::table().find(name);
    if (it == emu::table().end()) return fail("no such kernel");
    const emu::Entry& e = it->second;
    if ((int)e.sizes.size() != nargs) {
        return fail(std::to_string(nargs) + " arguments for " + std::to_string(e.sizes.size()) + " parameters");
    }
    for (int i = 0; i < nargs; ++i) {
        if (e.sizes[i] != sizes[i]) {
            return fail("argument " + std::to_string(i) + " has " + std::to_string(sizes[i]) + " bytes, the parameter " +
                        std::to_string(e.sizes[i]));
        }
    }
    const std::string r = emu::run({grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, e.body, e.fn, args);
    return r.empty() ? 0 : fail(r);
}

// How many kernels the library holds.
extern "C" int emu_kernels() { return (int)emu::table().size(); }
