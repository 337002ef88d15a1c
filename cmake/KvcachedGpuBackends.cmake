# Decides which GPU backends are built (KVCACHED_GPU_BACKENDS) and sets
# KVCACHED_BUILD_CUDA / KVCACHED_BUILD_HIP. Placeholder until the GPU backends land.
function(kvcached_configure_gpu_backends)
  set(KVCACHED_BUILD_CUDA OFF PARENT_SCOPE)
  set(KVCACHED_BUILD_HIP OFF PARENT_SCOPE)
  message(STATUS "kvcached: backends built: host")
endfunction()
