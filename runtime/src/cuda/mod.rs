//! The CUDA side of the runtime: finding a GPU and its libraries, and compiling the kernels of
//! `kernels/` with NVRTC.
//!
//! cudarc loads libcuda, libnvrtc and libcublas at run time (the `dynamic-loading` feature) and
//! panics on the first call into a library it cannot find. Every first touch here therefore goes
//! through a presence check ([`probe`]), and a missing driver, device or library is a
//! [`CudaError`] that names it: a build with the `cuda` feature runs on any machine.

pub mod blas;
pub mod cubin;
pub mod device;
pub mod dnn;
pub mod lt;
pub mod nvrtc;
pub mod plan;

use cudarc::driver::{result as drv, sys as drv_sys};

/// The CUDA version mpc is built for (cudarc's `cuda-13000`): the driver must be at least this.
pub const CUDA_VERSION: (i32, i32) = (13, 0);

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: libcuda was not found (is the NVIDIA driver installed?)")]
    NoDriver,
    #[error("the CUDA driver supports CUDA {}.{}, mpc needs {}.{} (driver 580 or later)", .found.0, .found.1, CUDA_VERSION.0, CUDA_VERSION.1)]
    DriverTooOld { found: (i32, i32) },
    #[error("the CUDA driver found no GPU")]
    NoDevice,
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("no NVRTC: libnvrtc was not found (it compiles mpc's kernels; put the CUDA toolkit's or the nvidia-cuda-nvrtc wheel's lib folder on LD_LIBRARY_PATH)")]
    NoNvrtc,
    #[error("no cuda_fp16.h for NVRTC: set MPC_CUDA_INCLUDE to the CUDA include folder")]
    NoHeaders,
    #[error("NVRTC could not compile kernels/{family}.cu for {arch}: {log}")]
    Compile { family: String, arch: String, log: String },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
}

/// One GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    pub ordinal: i32,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_bytes: u64,
}

impl Gpu {
    /// The real architecture NVRTC compiles for: `sm_90` for compute capability 9.0.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// What a machine offers: the driver, its GPUs and the libraries mpc uses, each found or not.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub driver: Option<(i32, i32)>,
    pub gpus: Vec<Gpu>,
    pub nvrtc: Option<(i32, i32)>,
    pub cublas: bool,
    pub cublaslt: bool,
    /// Why no GPU can run mpc's programs, if none can.
    pub problem: Option<CudaError>,
}

fn driver_error(e: drv::DriverError) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

/// The GPUs, or why there are none. Touches the driver only once it is known to be loadable.
pub fn gpus() -> Result<(Vec<Gpu>, (i32, i32)), CudaError> {
    // SAFETY: only tries to open the library; no symbol of it is called.
    if !unsafe { drv_sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    let mut v = 0;
    // SAFETY: the library is present; cuDriverGetVersion writes one int and needs no init.
    unsafe { drv_sys::cuDriverGetVersion(&mut v) }.result().map_err(driver_error)?;
    let version = (v / 1000, (v % 1000) / 10);
    if version < CUDA_VERSION {
        return Err(CudaError::DriverTooOld { found: version });
    }
    drv::init().map_err(driver_error)?;
    let n = drv::device::get_count().map_err(driver_error)?;
    let mut out = Vec::new();
    for ordinal in 0..n {
        let dev = drv::device::get(ordinal).map_err(driver_error)?;
        let attr = |a| {
            // SAFETY: `dev` came from device::get.
            unsafe { drv::device::get_attribute(dev, a) }.map_err(driver_error)
        };
        let major = attr(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        // SAFETY: `dev` came from device::get.
        let memory_bytes = unsafe { drv::device::total_mem(dev) }.map_err(driver_error)? as u64;
        out.push(Gpu {
            ordinal,
            name: drv::device::get_name(dev).map_err(driver_error)?,
            compute_capability: (major, minor),
            memory_bytes,
        });
    }
    if out.is_empty() {
        return Err(CudaError::NoDevice);
    }
    Ok((out, version))
}

/// Everything `mpc devices` prints.
pub fn probe() -> Report {
    let mut r = Report {
        nvrtc: nvrtc::version().ok(),
        // SAFETY: only tries to open the libraries.
        cublas: unsafe { cudarc::cublas::sys::is_culib_present() },
        // SAFETY: as above.
        cublaslt: unsafe { cudarc::cublaslt::sys::is_culib_present() },
        ..Report::default()
    };
    match gpus() {
        Ok((g, v)) => {
            r.gpus = g;
            r.driver = Some(v);
        }
        Err(e) => {
            if let CudaError::DriverTooOld { found } = e {
                r.driver = Some(found);
            }
            r.problem = Some(e);
        }
    }
    if r.problem.is_none() && r.nvrtc.is_none() {
        r.problem = Some(CudaError::NoNvrtc);
    }
    r
}
