# GPU backend modules kvcached._cuda and kvcached._hip, one per backend built.
# Included at the end of cpp/bindings/CMakeLists.txt (KVCACHED_STUB_PACKAGE is set there).

# One module: extension target `name` from gpu/<source>, linking `backend_target`,
# plus its typed stub <name>.pyi.
function(kvcached_add_gpu_module name source backend_target)
  nanobind_add_module(${name} NB_STATIC "${CMAKE_CURRENT_SOURCE_DIR}/gpu/${source}")
  target_link_libraries(${name} PRIVATE ${backend_target})
  target_include_directories(${name} PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${KVCACHED_STUB_PACKAGE}")
  install(TARGETS ${name} LIBRARY DESTINATION kvcached)

  # Stub generation imports the module, which needs libcuda.so.1 to load even
  # though it calls nothing at import. The build machine may have no NVIDIA
  # driver, so the import runs with the link stub's directory first on the
  # library path. Only this build step sees it; the module's RPATH does not.
  set(stub_file "${CMAKE_CURRENT_BINARY_DIR}/${name}.pyi")
  set(library_path "")
  if(KVCACHED_CUDA_LINK_STUB_DIR)
    set(library_path "LD_LIBRARY_PATH=${KVCACHED_CUDA_LINK_STUB_DIR}")
  endif()
  add_custom_command(
    OUTPUT "${stub_file}"
    COMMAND "${CMAKE_COMMAND}" -E env ${library_path}
            "${Python_EXECUTABLE}" -m nanobind.stubgen -q
            -i "${CMAKE_BINARY_DIR}/python" -m "kvcached.${name}" -o "${stub_file}"
    DEPENDS ${name}
    COMMENT "Generating ${name}.pyi"
    VERBATIM)
  add_custom_target(${name}_stub ALL DEPENDS "${stub_file}")
  install(FILES "${stub_file}" DESTINATION kvcached)
endfunction()

if(KVCACHED_BUILD_CUDA)
  kvcached_add_gpu_module(_cuda cuda_module.cpp kvcached_cuda_backend)
endif()
if(KVCACHED_BUILD_HIP)
  kvcached_add_gpu_module(_hip hip_module.cpp kvcached_hip_backend)
endif()
