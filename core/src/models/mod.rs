//! Transformer models in tch with Hugging Face parameter names, one file per architecture
//! (the config struct beside the model), plus checkpoint and tokenizer I/O.

pub mod bert;
pub mod dropout;
pub mod onednn;
pub mod pooling;
pub mod t5;
pub mod tokenizer;
pub mod weights;

use tch::{Device, Tensor};

/// `t` (on the CPU) copied to `device` without waiting for the device: on CUDA through pinned
/// memory and an asynchronous copy (a copy from pageable memory synchronises the stream, so
/// the host would wait for every kernel queued before it, the previous step's backward pass
/// included, and the device then idle while the host queues the next ones); elsewhere, or if
/// pinning fails, a plain copy.
pub fn upload(t: &Tensor, device: Device) -> Tensor {
    if device.is_cuda() && t.device() == Device::Cpu {
        if let Ok(on_device) = t.f_pin_memory(device).and_then(|pinned| pinned.f_to_device_(device, pinned.kind(), true, false)) {
            return on_device;
        }
    }
    t.to_device(device)
}
