from engine.loop.core_main import leave, main

leave(main())
