//! Opening a device: driver and NVRTC loaded at run time, the kernels compiled for the
//! device's architecture once and cached on disk by a hash of their source and options.

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, PinnedHostSlice};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The kernels' CUDA C, one compilation unit: the quantized products, then the decode step's
/// float operations.
const SOURCE: &str = concat!(include_str!("kernels/quant.cu"), "\n", include_str!("kernels/step.cu"));

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver on this machine (libcuda.so was not found): the CUDA backend needs an NVIDIA GPU and its driver")]
    NoDriver,
    #[error("NVRTC (libnvrtc.so) was not found: install the CUDA toolkit's NVRTC, or add the folder that holds it (often /usr/local/cuda/lib64) to LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("CUDA device {ordinal}: {source}")]
    Open { ordinal: usize, source: DriverError },
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
    #[error("compiling the CUDA kernels for {arch} failed: {log}")]
    Compile { arch: String, log: String },
    #[error("no CUDA kernel for {0} weights")]
    Unsupported(sluice_kernels::DType),
    #[error("{0}")]
    Shape(String),
}

/// An open CUDA device with the kernels loaded.
pub struct Gpu {
    /// Kept so the context outlives the module and stream made from it.
    _ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Every kernel, loaded once (a lookup per launch costs more than a small matvec).
    functions: HashMap<String, CudaFunction>,
    /// The grouped matmul's table (matrix pointers, segments, activation rows), reused.
    pub(crate) meta: Mutex<Option<CudaSlice<u8>>>,
    /// The stream the VRAM tier copies experts on, made when first needed.
    copy: Mutex<Option<Arc<CudaStream>>>,
    /// Host ranges page-locked now (start, end), by `register_host` or `register_blob`.
    locked: Arc<Mutex<Vec<(usize, usize)>>>,
    /// The device's name, as the driver gives it.
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
}

impl Gpu {
    /// Opens device `ordinal`, compiling the kernels (or loading them from the cache).
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        // SAFETY: only probes whether the libraries can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).map_err(|source| GpuError::Open { ordinal, source })?;
        let capability = ctx.compute_capability()?;
        let name = ctx.name()?;
        let total_mem = ctx.total_mem()?;
        let ptx = kernels_for(capability)?;
        let module = ctx.load_module(Ptx::from_src(ptx))?;
        let mut functions = HashMap::new();
        for name in crate::kernel_entry_points() {
            let f = module.load_function(&name)?;
            functions.insert(name, f);
        }
        // Streams are ordered by the events this crate records and waits on (the VRAM tier's
        // copy stream and the compute stream); cudarc's own per-buffer tracking would add an
        // event to every launch.
        // SAFETY: every buffer is used on the stream that allocated it, except the VRAM
        // tier's slab, whose allocation is synchronized before the copy stream touches it.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        Ok(Gpu {
            _ctx: ctx,
            stream,
            functions,
            meta: Mutex::new(None),
            copy: Mutex::new(None),
            locked: Arc::default(),
            name,
            capability,
            total_mem,
        })
    }

    pub(crate) fn function(&self, name: &str) -> &CudaFunction {
        self.functions.get(name).unwrap_or_else(|| panic!("kernel {name} is not in kernel_entry_points"))
    }

    /// The stream expert copies go on (one per device).
    pub(crate) fn copy_stream(&self) -> Result<Arc<CudaStream>, GpuError> {
        let mut c = self.copy.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_none() {
            *c = Some(self.stream.context().new_stream()?);
        }
        Ok(c.as_ref().expect("made above").clone())
    }

    /// Waits for all work queued on the device.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    /// The stream kernels run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// A page-locked host buffer for the small copies each call makes (a step's hidden states
/// down, its products back). From ordinary memory a copy is staged through the driver's own
/// buffer and returns only once done; from this one it is a plain asynchronous transfer, and
/// the call waits once, when it needs the results.
#[derive(Default)]
pub(crate) struct Staging {
    buf: Option<PinnedHostSlice<f32>>,
}

impl Staging {
    /// The buffer's first `len` values, made (twice as large, to grow rarely) when it holds
    /// fewer. The caller keeps the stream's order: nothing queued may still read or write the
    /// buffer when the host touches it.
    pub(crate) fn room(&mut self, gpu: &Gpu, len: usize) -> Result<&mut [f32], GpuError> {
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = None;
            // SAFETY: the memory comes back unset; it is zero-filled below before anything
            // reads it, and zero is a valid f32. Flags 0: cached (not write-combined), since
            // the host reads results from it.
            let mut b = unsafe { gpu.stream.context().alloc_pinned_with_flags::<f32>((2 * len).max(1024), 0) }?;
            b.as_mut_slice()?.fill(0.0);
            self.buf = Some(b);
        }
        Ok(&mut self.buf.as_mut().expect("made above").as_mut_slice()?[..len])
    }
}

/// Host memory page-locked for the device while this lives: copies from it to the device
/// go straight over the bus (from ordinary memory they are staged, several times slower).
/// The memory stays borrowed (or, from `register_blob`, owned), so it cannot be freed or
/// moved meanwhile.
pub struct HostRegistration<'a> {
    ptr: *mut std::ffi::c_void,
    range: (usize, usize),
    ctx: Arc<CudaContext>,
    locked: Arc<Mutex<Vec<(usize, usize)>>>,
    /// The buffer a `register_blob` registration keeps alive.
    _keep: Option<sluice_formats::Blob>,
    _mem: std::marker::PhantomData<&'a [u8]>,
}

// SAFETY: the pointer only names the registered range for the driver and the registry; the
// memory itself is borrowed immutably (or owned through the blob), so moving the registration
// between threads moves no access to it.
unsafe impl Send for HostRegistration<'_> {}
unsafe impl Sync for HostRegistration<'_> {}

impl HostRegistration<'_> {
    pub fn bytes(&self) -> usize {
        self.range.1 - self.range.0
    }
}

impl Gpu {
    /// Page-locks `mem` for copies to this device.
    pub fn register_host<'a>(&self, mem: &'a [u8]) -> Result<HostRegistration<'a>, GpuError> {
        self.register(mem, None)
    }

    /// Page-locks a blob's bytes for as long as the registration lives, which keeps the
    /// blob's buffer alive (a resident copy of a layer's experts, say).
    pub fn register_blob(&self, blob: sluice_formats::Blob) -> Result<HostRegistration<'static>, GpuError> {
        let mem: &[u8] = &blob;
        // SAFETY: the bytes live in the blob's shared buffer, which the registration keeps
        // (its `_keep`) and which is never written or freed while a blob refers to it; moving
        // the `Blob` handle does not move them.
        let mem: &'static [u8] = unsafe { std::slice::from_raw_parts(mem.as_ptr(), mem.len()) };
        self.register(mem, Some(blob))
    }

    fn register<'a>(
        &self,
        mem: &'a [u8],
        keep: Option<sluice_formats::Blob>,
    ) -> Result<HostRegistration<'a>, GpuError> {
        let ctx = self.stream.context().clone();
        ctx.bind_to_thread()?;
        let ptr = mem.as_ptr() as *mut std::ffi::c_void;
        if mem.is_empty() {
            return Err(GpuError::Shape("page-locking an empty range".into()));
        }
        // SAFETY: `mem` is a live allocation of `mem.len()` bytes, borrowed (or kept) for as
        // long as the registration lives; read-only use is all the driver makes of it (device
        // copies from it), so the shared borrow holds.
        unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr, mem.len(), 0) }.result()?;
        let range = (ptr as usize, ptr as usize + mem.len());
        self.locked.lock().unwrap_or_else(|p| p.into_inner()).push(range);
        Ok(HostRegistration {
            ptr,
            range,
            ctx,
            locked: self.locked.clone(),
            _keep: keep,
            _mem: std::marker::PhantomData,
        })
    }

    /// Whether all of `mem` lies in one page-locked range.
    pub fn is_locked(&self, mem: &[u8]) -> bool {
        let (a, b) = (mem.as_ptr() as usize, mem.as_ptr() as usize + mem.len());
        self.locked.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|&(s, e)| s <= a && b <= e)
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        {
            let mut l = self.locked.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = l.iter().position(|r| *r == self.range) {
                l.swap_remove(i);
            }
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by `register` and not unregistered since; copies
            // from it were waited on before the borrow could end.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr) };
        }
    }
}

/// NVRTC's options. `--fmad=false`: no product is fused with an addition unless the source
/// says `fmaf`, so the float formula rounds exactly as the CPU reference does.
fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--fmad=false".into(), "--std=c++17".into()]
}

/// PTX of the kernels for a device of compute capability `cc`: from the cache when a file
/// for this source, these options and this architecture is there, else compiled and cached.
fn kernels_for(cc: (i32, i32)) -> Result<String, GpuError> {
    let arch = format!("compute_{}{}", cc.0, cc.1);
    let opts = options(&arch);
    let key = xxhash_rust::xxh3::xxh3_64(format!("{SOURCE}\0{}", opts.join(" ")).as_bytes());
    let path = cache_dir().map(|d| d.join(format!("kernels-{arch}-{key:016x}.ptx")));
    if let Some(ptx) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(ptx);
    }
    let ptx = compile_kernels(&arch)?;
    if let Some(p) = path {
        // A cache that cannot be written only costs a compile next time.
        let _ = write_atomically(&p, &ptx);
    }
    Ok(ptx)
}

/// Compiles the kernels to PTX for `arch` (`compute_90`, say) with NVRTC; needs no GPU.
pub fn compile_kernels(arch: &str) -> Result<String, GpuError> {
    // SAFETY: only probes whether the library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::NoNvrtc);
    }
    let compiled = cudarc::nvrtc::compile_ptx_with_opts(
        SOURCE,
        CompileOptions { options: options(arch), name: Some("sluice_quant.cu".into()), ..Default::default() },
    )
    .map_err(|e| GpuError::Compile { arch: arch.to_string(), log: compile_log(e) })?;
    Ok(compiled.to_src())
}

fn compile_log(e: cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

/// `$SLUICE_CUDA_CACHE`, else `$XDG_CACHE_HOME/sluice/cuda`, else `~/.cache/sluice/cuda`.
fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("SLUICE_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("sluice").join("cuda"))
}

fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().ok_or(std::io::ErrorKind::InvalidInput)?;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_without_a_driver_is_an_error_not_a_panic() {
        // SAFETY: only probes whether the library can be loaded.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        match Gpu::open(0) {
            Err(GpuError::NoDriver) => assert!(!present, "the driver is present but open said it is not"),
            Err(GpuError::Open { .. }) | Ok(_) => assert!(present, "open found a driver that is not there"),
            Err(e) => assert!(present, "unexpected error without a driver: {e}"),
        }
    }

    #[test]
    fn kernels_are_compiled_without_fused_multiply_adds() {
        let o = options("compute_90");
        assert!(o.iter().any(|s| s == "--fmad=false"), "{o:?}");
        assert!(o.iter().any(|s| s == "--gpu-architecture=compute_90"), "{o:?}");
    }
}
