//! libc memory calls that can unmap or replace pages under a cached
//! registration. Each one queues the affected range for the registration
//! cache (no allocation, no cache lock, never a deregistration: this runs
//! inside arbitrary application code) and calls the real function.
//! glibc's internal unmaps (inside `free()`) do not come here: the
//! userfaultfd monitor sees those (`mr/monitor.rs`).

use crate::mr::QUEUE;
use libc::{c_int, c_void, intptr_t, off_t, size_t};
use std::sync::atomic::{AtomicPtr, Ordering};

/// A libc function resolved with `dlsym(RTLD_NEXT)`, once.
pub(super) struct Next(pub(super) AtomicPtr<c_void>, pub(super) &'static std::ffi::CStr);

impl Next {
    pub(super) fn get(&self) -> *mut c_void {
        let p = self.0.load(Ordering::Relaxed);
        if !p.is_null() {
            return p;
        }
        // SAFETY: dlsym with a valid NUL-terminated name.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, self.1.as_ptr()) };
        self.0.store(p, Ordering::Relaxed);
        p
    }
}

macro_rules! next {
    ($name:ident, $sym:literal) => {
        static $name: Next = Next(AtomicPtr::new(std::ptr::null_mut()), $sym);
    };
}
next!(MUNMAP, c"munmap");
next!(MREMAP, c"mremap");
next!(MADVISE, c"madvise");
next!(MMAP, c"mmap");
next!(MMAP64, c"mmap64");
next!(BRK, c"brk");
next!(SBRK, c"sbrk");
next!(SHMDT, c"shmdt");

/// Resolve everything at load time rather than inside a first hook call.
#[ctor::ctor]
fn resolve_libc() {
    for n in [&MUNMAP, &MREMAP, &MADVISE, &MMAP, &MMAP64, &BRK, &SBRK, &SHMDT] {
        n.get();
    }
}

/// Call the real function `$next` with type `$ty`, or fail with ENOSYS.
macro_rules! real {
    ($next:expr, $ty:ty, $fail:expr, ($($a:expr),*)) => {{
        let p = $next.get();
        if p.is_null() {
            // SAFETY: the thread's errno slot.
            unsafe { *libc::__errno_location() = libc::ENOSYS };
            $fail
        } else {
            // SAFETY: the libc symbol of that name has this signature.
            unsafe { std::mem::transmute::<*mut c_void, $ty>(p)($($a),*) }
        }
    }};
}

fn note(start: usize, len: usize) {
    QUEUE.push(start, start.saturating_add(len));
}

#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    note(addr as usize, len);
    real!(MUNMAP, unsafe extern "C" fn(*mut c_void, size_t) -> c_int, -1, (addr, len))
}

/// `mremap(old, old_size, new_size, flags, ... /* new_address */)`. Rust
/// cannot define a variadic function; on x86-64 and aarch64 Linux the
/// optional pointer travels in the same register as a fifth named
/// argument, and it is read only when MREMAP_FIXED says it was passed.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_size: size_t,
    new_size: size_t,
    flags: c_int,
    new_address: *mut c_void,
) -> *mut c_void {
    note(old as usize, old_size);
    if flags & libc::MREMAP_FIXED != 0 {
        note(new_address as usize, new_size);
    }
    real!(
        MREMAP,
        unsafe extern "C" fn(*mut c_void, size_t, size_t, c_int, *mut c_void) -> *mut c_void,
        libc::MAP_FAILED,
        (old, old_size, new_size, flags, new_address)
    )
}

#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    if matches!(advice, libc::MADV_DONTNEED | libc::MADV_FREE | libc::MADV_REMOVE) {
        note(addr as usize, len);
    }
    real!(MADVISE, unsafe extern "C" fn(*mut c_void, size_t, c_int) -> c_int, -1, (addr, len, advice))
}

type MmapFn = unsafe extern "C" fn(*mut c_void, size_t, c_int, c_int, c_int, off_t) -> *mut c_void;

#[no_mangle]
pub unsafe extern "C" fn mmap(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void {
    if flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) == libc::MAP_FIXED {
        note(addr as usize, len);
    }
    real!(MMAP, MmapFn, libc::MAP_FAILED, (addr, len, prot, flags, fd, off))
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void {
    if flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) == libc::MAP_FIXED {
        note(addr as usize, len);
    }
    real!(MMAP64, MmapFn, libc::MAP_FAILED, (addr, len, prot, flags, fd, off))
}

/// The current program break (glibc's `sbrk(0)` only reads it).
fn current_break() -> usize {
    real!(SBRK, unsafe extern "C" fn(intptr_t) -> *mut c_void, std::ptr::null_mut(), (0)) as usize
}

#[no_mangle]
pub unsafe extern "C" fn brk(addr: *mut c_void) -> c_int {
    let cur = current_break();
    if (addr as usize) < cur {
        note(addr as usize, cur - addr as usize);
    }
    real!(BRK, unsafe extern "C" fn(*mut c_void) -> c_int, -1, (addr))
}

#[no_mangle]
pub unsafe extern "C" fn sbrk(increment: intptr_t) -> *mut c_void {
    if increment < 0 {
        let cur = current_break();
        note(cur - increment.unsigned_abs(), increment.unsigned_abs());
    }
    real!(SBRK, unsafe extern "C" fn(intptr_t) -> *mut c_void, usize::MAX as *mut c_void, (increment))
}

/// The segment's size is not an argument: everything from `addr` up is
/// treated as replaced (sound, and shmdt is rare next to registrations).
#[no_mangle]
pub unsafe extern "C" fn shmdt(addr: *const c_void) -> c_int {
    note(addr as usize, usize::MAX - addr as usize);
    real!(SHMDT, unsafe extern "C" fn(*const c_void) -> c_int, -1, (addr))
}
