# NOTE [Linking against the torch wheel]
# libtorch_cuda.so from the PyPI wheel finds its CUDA libraries (NCCL, cuDNN, ...) at run time through its own
# RPATH into site-packages/nvidia/*/lib. The linker of an executable does not follow that RPATH, and may take an
# older system copy (e.g. the toolkit's NCCL) and fail on missing symbols; -rpath-link points it at the wheel's.
# Sets AMPKIT_TORCH_RPATH_LINK to the linker option (empty when the wheel ships no such folders).
function(ampkit_torch_rpath_link torch_lib_dir)
  file(GLOB _dirs LIST_DIRECTORIES true "${torch_lib_dir}/../../nvidia/*/lib")
  set(_opt "")
  if(_dirs)
    list(JOIN _dirs ":" _joined)
    set(_opt "LINKER:-rpath-link,${_joined}")
  endif()
  set(AMPKIT_TORCH_RPATH_LINK "${_opt}" PARENT_SCOPE)
endfunction()
