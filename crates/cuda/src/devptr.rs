//! [`DevPtr`]: a device address as the kernels take it.

/// A device address: what a kernel's pointer parameter receives, passed by
/// value (the 8 bytes of a `CUdeviceptr`). Offsets are explicit about their
/// unit ([`DevPtr::add_bytes`], [`DevPtr::add_f32`]); [`DevPtr::NULL`]
/// stands for "none" where a kernel takes an optional input.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DevPtr(u64);

impl DevPtr {
    /// No buffer (a kernel's optional input left out).
    pub const NULL: DevPtr = DevPtr(0);

    /// The address the driver returned.
    pub fn from_raw(addr: u64) -> DevPtr {
        DevPtr(addr)
    }

    /// The address as the driver and device-side tables hold it.
    pub fn raw(self) -> u64 {
        self.0
    }

    /// Whether this is [`DevPtr::NULL`].
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// Whether the address is a multiple of `bytes` (a kernel's vector
    /// loads need it).
    pub fn is_aligned(self, bytes: usize) -> bool {
        self.0.is_multiple_of(bytes as u64)
    }

    /// The address `bytes` bytes further on.
    pub fn add_bytes(self, bytes: usize) -> DevPtr {
        DevPtr(self.0 + bytes as u64)
    }

    /// The address of f32 element `i` of an array starting here.
    pub fn add_f32(self, i: usize) -> DevPtr {
        self.add_bytes(4 * i)
    }
}

// SAFETY: a transparent u64, the representation of the kernels' pointer
// parameters (and of `CUdeviceptr`).
unsafe impl cudarc::driver::DeviceRepr for DevPtr {}
