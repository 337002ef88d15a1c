# Decides which GPU backends are built (KVCACHED_GPU_BACKENDS) and defines one
# static library per backend that the Python modules and the benchmark link
# (the host backend, kvcached_host_backend, is always built: CMakeLists.txt):
#
#   kvcached_cuda_backend  cpp/src/cuda, CUDA driver API, links libcuda
#   kvcached_hip_backend   cpp/src/hip, HIP runtime, host compiler, links libamdhip64
#
# CUDA needs only cuda.h to compile. To link it needs libcuda, which ships with
# the NVIDIA *driver*, not the toolkit; a build machine often has no driver. Then
# we link against a tiny "link stub" built here (SONAME libcuda.so.1, every entry
# point returns CUDA_ERROR_STUB_LIBRARY). The stub is never installed and never
# put on an RPATH, so at run time the loader finds the real driver's libcuda.so.1.
#
# Sets KVCACHED_BUILD_CUDA, KVCACHED_BUILD_HIP and KVCACHED_CUDA_USES_LINK_STUB
# in the caller's scope.

option(KVCACHED_BUILD_EMULATION
       "Build the test-only emulated CUDA / HIP driver libraries (tests/emulation)" OFF)

# Header directories the PyPI CUDA runtime wheels install cuda.h into
# (nvidia-cuda-runtime for CUDA 13: nvidia/cu13/include; -cu12: nvidia/cuda_runtime/include).
function(_kvcached_pip_cuda_include_dirs out_var)
  set(dirs "")
  find_package(Python QUIET COMPONENTS Interpreter)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c [=[
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations if spec else []):
    for sub in ("cu13/include", "cuda_runtime/include", "cu12/include"):
        d = os.path.join(root, sub)
        if os.path.isfile(os.path.join(d, "cuda.h")):
            print(d, end=";")
]=]
      OUTPUT_VARIABLE dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  set(${out_var} "${dirs}" PARENT_SCOPE)
endfunction()

# Finds cuda.h; sets KVCACHED_CUDA_INCLUDE_DIR (cache, may be given with -D).
function(_kvcached_find_cuda_headers)
  find_package(CUDAToolkit QUIET)
  _kvcached_pip_cuda_include_dirs(pip_dirs)
  find_path(KVCACHED_CUDA_INCLUDE_DIR cuda.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV CUDA_HOME ENV CUDA_PATH
    PATH_SUFFIXES include
    PATHS /usr/local/cuda/include ${pip_dirs}
    DOC "Directory holding the CUDA driver API header cuda.h")
endfunction()

# Finds hip/hip_runtime_api.h and libamdhip64 (ROCm or Debian's libamdhip64-dev).
function(_kvcached_find_hip)
  find_path(KVCACHED_HIP_INCLUDE_DIR hip/hip_runtime_api.h
    HINTS ENV ROCM_PATH ENV HIP_PATH
    PATH_SUFFIXES include
    PATHS /opt/rocm/include
    DOC "Directory holding hip/hip_runtime_api.h")
  find_library(KVCACHED_HIP_LIBRARY amdhip64
    HINTS ENV ROCM_PATH ENV HIP_PATH
    PATH_SUFFIXES lib lib64
    PATHS /opt/rocm/lib
    DOC "The HIP runtime library libamdhip64")
endfunction()

# Interface target kvcached_cuda_driver: the real libcuda when one is found,
# otherwise the link stub. Sets KVCACHED_CUDA_USES_LINK_STUB in the caller.
function(_kvcached_add_cuda_driver_target source_dir)
  add_library(kvcached_cuda_driver INTERFACE)
  target_include_directories(kvcached_cuda_driver INTERFACE "${KVCACHED_CUDA_INCLUDE_DIR}")

  # The link stub is always built: stub generation imports the module on the
  # build machine, which may have no driver (see gpu_modules.cmake).
  add_library(kvcached_cuda_link_stub SHARED "${source_dir}/cpp/src/cuda/cuda_link_stub.c")
  target_include_directories(kvcached_cuda_link_stub PRIVATE "${KVCACHED_CUDA_INCLUDE_DIR}")
  set_target_properties(kvcached_cuda_link_stub PROPERTIES
    OUTPUT_NAME cuda
    SOVERSION 1  # SONAME libcuda.so.1, the name the real driver library has
    LIBRARY_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/cuda-link-stub")
  set(KVCACHED_CUDA_LINK_STUB_DIR "${CMAKE_BINARY_DIR}/cuda-link-stub" PARENT_SCOPE)

  set(uses_stub OFF)
  if(TARGET CUDA::cuda_driver)
    target_link_libraries(kvcached_cuda_driver INTERFACE CUDA::cuda_driver)
  else()
    find_library(KVCACHED_CUDA_DRIVER_LIBRARY cuda
      HINTS ENV CUDA_HOME ENV CUDA_PATH
      PATH_SUFFIXES lib64 lib lib64/stubs lib/stubs
      DOC "The CUDA driver library libcuda (empty: link against the build-tree stub)")
    if(KVCACHED_CUDA_DRIVER_LIBRARY)
      target_link_libraries(kvcached_cuda_driver INTERFACE "${KVCACHED_CUDA_DRIVER_LIBRARY}")
    else()
      # A raw -L option plus -lcuda: CMake puts the directories of linked
      # targets and of target_link_directories on the build-tree RPATH, and the
      # stub must never be found at run time.
      set(uses_stub ON)
      target_link_options(kvcached_cuda_driver INTERFACE "-L${CMAKE_BINARY_DIR}/cuda-link-stub")
      target_link_libraries(kvcached_cuda_driver INTERFACE cuda)
    endif()
  endif()
  set(KVCACHED_CUDA_USES_LINK_STUB ${uses_stub} PARENT_SCOPE)
endfunction()

function(kvcached_configure_gpu_backends)
  set(source_dir "${PROJECT_SOURCE_DIR}")
  set(requested "${KVCACHED_GPU_BACKENDS}")
  if(NOT requested MATCHES "^(auto|none|cuda|hip|all)$")
    message(FATAL_ERROR
      "kvcached: KVCACHED_GPU_BACKENDS='${requested}' is not one of auto, none, cuda, hip, all")
  endif()

  set(want_cuda OFF)
  set(want_hip OFF)
  set(need_cuda OFF)
  set(need_hip OFF)
  if(requested STREQUAL "auto")
    set(want_cuda ON)
    set(want_hip ON)
  endif()
  if(requested STREQUAL "cuda" OR requested STREQUAL "all")
    set(want_cuda ON)
    set(need_cuda ON)
  endif()
  if(requested STREQUAL "hip" OR requested STREQUAL "all")
    set(want_hip ON)
    set(need_hip ON)
  endif()

  set(build_cuda OFF)
  set(build_hip OFF)
  set(KVCACHED_CUDA_USES_LINK_STUB OFF)
  set(built "host")

  if(want_cuda)
    _kvcached_find_cuda_headers()
    if(KVCACHED_CUDA_INCLUDE_DIR)
      set(build_cuda ON)
    elseif(need_cuda)
      message(FATAL_ERROR
        "kvcached: KVCACHED_GPU_BACKENDS=${requested} needs the CUDA header cuda.h, which was "
        "not found. Install the CUDA toolkit (or `pip install nvidia-cuda-runtime` and build "
        "without build isolation), or pass -DKVCACHED_CUDA_INCLUDE_DIR=/path/to/include.")
    endif()
  endif()

  if(want_hip)
    _kvcached_find_hip()
    if(KVCACHED_HIP_INCLUDE_DIR AND KVCACHED_HIP_LIBRARY)
      set(build_hip ON)
    elseif(need_hip)
      message(FATAL_ERROR
        "kvcached: KVCACHED_GPU_BACKENDS=${requested} needs the HIP headers and libamdhip64 "
        "(header dir: '${KVCACHED_HIP_INCLUDE_DIR}', library: '${KVCACHED_HIP_LIBRARY}'). "
        "Install ROCm (or Debian's libamdhip64-dev), or set ROCM_PATH.")
    endif()
  endif()

  if(build_cuda)
    _kvcached_add_cuda_driver_target("${source_dir}")
    file(GLOB cuda_sources CONFIGURE_DEPENDS "${source_dir}/cpp/src/cuda/*.cpp")
    add_library(kvcached_cuda_backend STATIC ${cuda_sources})
    target_include_directories(kvcached_cuda_backend PUBLIC "${source_dir}/cpp/include")
    target_include_directories(kvcached_cuda_backend PRIVATE "${source_dir}/cpp/src")
    target_link_libraries(kvcached_cuda_backend PUBLIC kvcached_cuda_driver Threads::Threads)
    # Order the stub before anything that links it (-lcuda finds it by directory).
    add_dependencies(kvcached_cuda_backend kvcached_cuda_link_stub)
    if(KVCACHED_CUDA_USES_LINK_STUB)
      string(APPEND built " cuda(link stub: no libcuda found, the driver's libcuda.so.1 is used at run time)")
    else()
      string(APPEND built " cuda")
    endif()
  endif()

  if(build_hip)
    file(GLOB hip_sources CONFIGURE_DEPENDS "${source_dir}/cpp/src/hip/*.cpp")
    add_library(kvcached_hip_backend STATIC ${hip_sources})
    target_include_directories(kvcached_hip_backend PUBLIC "${source_dir}/cpp/include")
    target_include_directories(kvcached_hip_backend PRIVATE "${source_dir}/cpp/src")
    # The HIP headers select their host-only API with this macro; no hipcc needed.
    target_include_directories(kvcached_hip_backend PRIVATE "${KVCACHED_HIP_INCLUDE_DIR}")
    target_compile_definitions(kvcached_hip_backend PRIVATE __HIP_PLATFORM_AMD__)
    target_link_libraries(kvcached_hip_backend PUBLIC "${KVCACHED_HIP_LIBRARY}" Threads::Threads)
    string(APPEND built " hip")
  endif()

  message(STATUS "kvcached: backends built: ${built}")

  set(KVCACHED_BUILD_CUDA ${build_cuda} PARENT_SCOPE)
  set(KVCACHED_BUILD_HIP ${build_hip} PARENT_SCOPE)
  set(KVCACHED_CUDA_USES_LINK_STUB ${KVCACHED_CUDA_USES_LINK_STUB} PARENT_SCOPE)
  set(KVCACHED_CUDA_LINK_STUB_DIR "${KVCACHED_CUDA_LINK_STUB_DIR}" PARENT_SCOPE)

  # Test-only: fake driver libraries over host memory, for GPU-less machines.
  if(KVCACHED_BUILD_EMULATION AND (build_cuda OR build_hip))
    set(KVCACHED_BUILD_CUDA ${build_cuda})
    set(KVCACHED_BUILD_HIP ${build_hip})
    add_subdirectory("${source_dir}/tests/emulation" "${CMAKE_BINARY_DIR}/tests/emulation")
  endif()
endfunction()
